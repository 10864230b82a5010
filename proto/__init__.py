"""The control-plane protocol (package ``kvdepot.v1``) and its generated code."""
