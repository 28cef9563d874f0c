"""``python -m alignlit.cli`` runs the ``alignlit`` command."""

from alignlit.cli import main

main()
