"""Helper modules of the test suite (not tests themselves): imported as ``helpers.<name>``.

One naming rule: a helper module is named for what it holds, without a leading underscore;
modules whose functions run on the worker ranks of one test file end in ``_scenarios``
(``tp_scenarios``, ``tp_export_scenarios``, ...). ``conftest.py`` puts ``tests/`` on
``sys.path``, and the spawned workers inherit it.
"""
