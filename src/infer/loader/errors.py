class ModelLoadError(ValueError):
    """A model that cannot be loaded; the message names the file and the problem."""
