"""The front door: every request, from the HTTP server or the embedded clients, becomes what the engine runs
here, once: the chat rendered with its tools, the token ids, the SamplingParams with the constraint a forced
tool call needs (not compiled: the engine compiles it where it runs), and the readers of the output's reasoning
(models that think in <think>) and tool calls."""
