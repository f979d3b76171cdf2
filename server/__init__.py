"""specserve's HTTP front end and command line (imports engine, never the reverse)."""
