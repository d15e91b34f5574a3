"""Unit tests of the queue's pure code: rules, ids, fingerprints."""
