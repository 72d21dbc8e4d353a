"""``python -m lightning_gradcomp.cli``: the ``gradcomp`` command."""

from lightning_gradcomp.cli.command import main

raise SystemExit(main())
