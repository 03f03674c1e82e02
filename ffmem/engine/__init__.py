"""ffmem's engine: everything that needs torch. Importable from a notebook; no web code."""
