"""The engine loop: the step, its scheduler-facing cores (EngineCore, PrefillEngine), the model runner and
what a request produces."""
