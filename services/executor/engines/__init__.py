"""The engines behind the `Engine` protocol (engine.py); plan.py says which one runs where."""
