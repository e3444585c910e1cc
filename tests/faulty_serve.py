"""``python -m tests.faulty_serve serve ...``: the real command line, with the ``faulty``
family known, so a server process can be held and released by its tests."""

from app.cli import main
from tests import faulty

faulty.register()
main()
