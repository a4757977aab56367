"""The backends behind the `Backend` protocol (backend.py); backend_choice.py says which one
runs where, loading.py loads it."""
