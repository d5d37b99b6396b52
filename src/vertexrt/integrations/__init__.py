"""Framework integrations: Lightning (:mod:`vertexrt.integrations.lightning`) and the Hugging Face
``Trainer`` (:mod:`vertexrt.integrations.huggingface`).

Importing this package imports no framework; each submodule imports its framework when it is imported.

Example:
    >>> from vertexrt.integrations.lightning import VertexCallback
    >>> from vertexrt.integrations.huggingface import VertexTrainerCallback
"""

__all__: list[str] = []
