"""The public surface of ``import fedclinic`` and the deprecated module paths of the 0.2 restructure."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import fedclinic
from fedclinic import _moved

PUBLIC = {"__version__", "PROTOCOL_VERSION", "connect", "Client", "Task", "FedclinicError", "ConfigError",
          "DatasetError", "IntegrityError", "PolicyError"}


def test_export_list_is_the_documented_surface():
    assert set(fedclinic.__all__) >= PUBLIC
    for name in fedclinic.__all__:
        assert getattr(fedclinic, name) is not None, name


def test_connect_and_task_are_the_real_objects():
    from fedclinic.client import Client, connect
    from fedclinic.spec.task import Task

    assert fedclinic.connect is connect and fedclinic.Client is Client and fedclinic.Task is Task
    assert issubclass(fedclinic.ConfigError, fedclinic.FedclinicError)


def test_unknown_attribute_raises_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fedclinic.nope  # noqa: B018


def test_import_fedclinic_loads_neither_torch_nor_grpc_client():
    """The services and serving import fedclinic; the public names must not drag torch in."""
    code = ("import sys, fedclinic; "
            "print(','.join(m for m in ('torch', 'transformers', 'fedclinic.client', 'fedclinic.spec.task') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


@pytest.mark.parametrize("old,new", sorted(_moved.MOVED_MODULES.items()))
def test_moved_module_imports_the_same_module_with_a_warning(old, new):
    if new.startswith(("fedclinic.export", "fedclinic.serving.generate")):
        pytest.importorskip("onnx")
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)


@pytest.mark.parametrize("package", sorted(_moved.MOVED_NAMES))
def test_package_that_replaced_a_module_resolves_its_old_names(package):
    target, names = _moved.MOVED_NAMES[package]
    pkg = importlib.import_module(package)
    name = sorted(names)[0]
    with pytest.warns(DeprecationWarning, match=target):
        value = getattr(pkg, name)
    assert value is getattr(importlib.import_module(target), name)
    with pytest.raises(AttributeError):
        getattr(pkg, "not_a_name_of_the_old_module")


def test_every_moved_target_exists():
    for new in _moved.MOVED_MODULES.values():
        assert importlib.util.find_spec(new) is not None, new
    for target, names in _moved.MOVED_NAMES.values():
        module = importlib.import_module(target)
        missing = [n for n in names if not hasattr(module, n)]
        assert not missing, (target, missing)
