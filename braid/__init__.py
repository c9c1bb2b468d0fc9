"""braid: braided TP/PP pipeline schedules, their compiler, simulator, executor and viewer."""

__version__ = "0.1.0"
