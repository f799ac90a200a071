"""rangefinder's pipeline steps and the engine they share."""

__version__ = "0.1.0"
