"""vocagno: vocabulary-agnostic teacher-guided language modelling (the library; never imports Hydra)."""

__version__ = "0.1.0"
