"""The front door: every request, from the HTTP server or the embedded clients, becomes what the engine runs
here, once: the chat rendered with its tools, the token ids, the SamplingParams with the constraint a forced
tool call needs (not compiled: the engine compiles it where it runs), and the reader of the output's tool
calls."""
