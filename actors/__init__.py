"""Actor subprocesses (prefill, decode) and their supervision by the main process."""
