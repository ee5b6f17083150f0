"""The reliability campaign (issue 16): fuzz, kills, network faults, disk full and load, over real processes on
loopback. ``make campaign`` runs every part in full (``python -m campaign.run``) and writes
docs/results/reliability.md; ``make test`` runs each part's smoke (tests/campaign/).

Each part is a module ``campaign.<part>`` with ``main(argv)`` taking ``--smoke`` (seconds, a few cases) and
``--out FILE``; it writes one :class:`campaign.fragment.Fragment` as JSON and prints one ``RESULT`` line.
"""
