"""The OpenAI-compatible HTTP server: `python cli.py serve` (entry point: server.main.serve; app factory:
server.app.create_app)."""
