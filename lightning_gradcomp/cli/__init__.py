"""The ``gradcomp`` command (``python -m lightning_gradcomp.cli``): ``fit``/``validate``/... through LightningCLI
(:mod:`~lightning_gradcomp.cli.command`), ``gradcomp compare`` (:mod:`~lightning_gradcomp.cli.compare`), ``gradcomp
strategies`` and the registries described for help texts (:mod:`~lightning_gradcomp.cli.catalog`). It sits on top of
the package: it imports every front end, and nothing below imports it."""

from lightning_gradcomp.cli.command import main, run_cli

__all__ = ["main", "run_cli"]
