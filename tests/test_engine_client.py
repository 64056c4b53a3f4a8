"""Both engine clients implement engine.core.client_protocol.EngineClient: the same methods, equally async, with the
same parameters (a structural check: the Protocol is not runtime_checkable, so nothing else enforces it)."""
import inspect

import pytest

from client.in_process import InProcessClient
from engine.core.client_protocol import ENGINE_CLIENT_METHODS, EngineClient
from router.router import ActorRouter

CLIENTS = [InProcessClient, ActorRouter]


def _protocol_methods() -> set[str]:
    methods = {name for name, value in vars(EngineClient).items() if inspect.isfunction(value)}
    return {name for name in methods if not name.startswith("_")}


def test_the_method_list_names_every_protocol_method():
    assert _protocol_methods() == set(ENGINE_CLIENT_METHODS)


@pytest.mark.parametrize("cls", CLIENTS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", ENGINE_CLIENT_METHODS)
def test_client_implements_the_method(cls, name):
    declared, implemented = getattr(EngineClient, name), getattr(cls, name, None)
    assert callable(implemented), f"{cls.__name__} lacks {name}"
    assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(declared)
    assert list(inspect.signature(implemented).parameters) == list(inspect.signature(declared).parameters)


@pytest.mark.parametrize("cls", CLIENTS, ids=lambda c: c.__name__)
def test_client_has_one_close_method(cls):
    assert not hasattr(cls, "shutdown")
