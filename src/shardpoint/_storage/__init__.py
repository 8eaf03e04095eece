"""Where checkpoints live. Local POSIX directories now; object stores through fsspec."""
