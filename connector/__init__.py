"""Client-side code that runs in a user's process: client, transports, engine connectors."""
