"""One ON_ERROR (issue 31): the Loader and convert take the same on_error choices, named once
in fastload/validate.py."""
from __future__ import annotations


def test_one_on_error_for_the_loader_and_convert():
    import fastload.convert.common as common
    import fastload.loader.options as options
    import fastload.validate as validate

    assert validate.ON_ERROR == ("raise", "skip")
    assert options.ON_ERROR is validate.ON_ERROR and common.ON_ERROR is validate.ON_ERROR
