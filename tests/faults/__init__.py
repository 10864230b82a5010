"""The fault suite: real daemons killed, restarted, starved of disk and cut off."""
