"""Every public name documents its arguments and results (a cheap coverage check)."""

import inspect
import types

import pytest

import gradtools


def _public_objects():
    for name in gradtools.__all__:
        obj = getattr(gradtools, name)
        if isinstance(obj, types.ModuleType):  # e.g. gradtools.schedules
            for sub in obj.__all__:
                yield f"{name}.{sub}", getattr(obj, sub)
        elif not isinstance(obj, str):
            yield name, obj


PUBLIC = dict(_public_objects())


def test_all_names_exist_and_are_sorted():
    assert sorted(gradtools.__all__) == list(gradtools.__all__)
    for name in gradtools.__all__:
        assert hasattr(gradtools, name), name


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_name_has_full_docstring(name):
    obj = PUBLIC[name]
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"{name} has no docstring"
    if inspect.isclass(obj):
        assert "Attributes:" in doc, f"{name}: docstring lacks an Attributes: section"
    else:
        sig = inspect.signature(obj)
        if sig.parameters:
            assert "Args:" in doc, f"{name}: docstring lacks an Args: section"
        assert "Returns:" in doc, f"{name}: docstring lacks a Returns: section"
