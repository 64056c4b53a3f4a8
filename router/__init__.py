"""The main process's request router: classification, placement and (with actors) dispatch."""
