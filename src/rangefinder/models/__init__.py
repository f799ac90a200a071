"""Base models: loading one from a folder, a single file or the hub, and the embedded tiny model."""
