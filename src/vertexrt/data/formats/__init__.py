"""Record formats: :mod:`.base` holds the protocol every reader implements (:class:`~.base.Format`, the
error policy :class:`~.base.Errors`, :class:`~.base.FileSource`), one module per format implements it,
and :mod:`.registry` maps names and extensions to formats. Formats import the base only, never the
registry, so the package has no import cycle; this module imports nothing.
"""
