"""The jobs: thin entry points, each `main(argv)` (`python jobs/NAME.py` of a checkout, or `hylo NAME`)."""
