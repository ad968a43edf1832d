"""The test suite, in folders by part: kernels/, model/ (hylo/), data/, teacher/, train/, eval/, jobs/ (the
command line, configs, Ray start-up, cluster files), project/ (packaging, layering, documented examples, the
suite's own layout) and e2e/ (whole runs). Shared helpers are in tests/helpers/, the one module tests import
besides the code under test (`from tests.helpers.train import ...`); no test module imports another.

Every folder is a package, so two test files may share a base name and pytest (`prepend` import mode) puts the
repository's root, not tests/, on sys.path."""
