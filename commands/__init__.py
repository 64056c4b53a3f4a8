"""What `python cli.py` needs beyond its parsers: argument groups, shell completion, the flag reference."""
