#!/bin/sh
# Runs COMMAND ARGS... (the image's: `kvdepot ...`) with the cluster token
# when the kvdepot_token secret holds one (a line neither blank nor a
# comment). The compose file mounts deploy/no-token there unless
# KVDEPOT_TOKEN_FILE names a real token file.
secret=/run/secrets/kvdepot_token
if [ -z "${KVDEPOT_AUTH_TOKEN:-}" ] && [ -z "${KVDEPOT_AUTH_TOKEN_FILE:-}" ] && [ -e "$secret" ]; then
    if [ ! -r "$secret" ]; then
        echo "kvdepot: error: cannot read the token secret $secret as uid $(id -u): make the host file readable by that user (chown $(id -u))" >&2
        exit 1
    fi
    if grep -qv -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$secret"; then
        export KVDEPOT_AUTH_TOKEN_FILE="$secret"
    fi
fi
exec "$@"
