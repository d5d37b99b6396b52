"""StateTracker: which attributes a Trainer checkpoints, and generator round trips."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vertexrt.runtime.state import GeneratorState, StateTracker, as_stateful


class App(StateTracker):
    untracked = ("eval_reader",)


class Reader:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def test_tracks_stateful_attributes_in_assignment_order() -> None:
    app = App()
    app.model = torch.nn.Linear(2, 1)
    app.optimizer = torch.optim.SGD(app.model.parameters(), lr=0.1)
    app.scheduler = torch.optim.lr_scheduler.StepLR(app.optimizer, step_size=1)
    app.reader = Reader()
    app.lr = 0.1
    app.name = "run"
    assert list(app.app_state()) == ["model", "optimizer", "scheduler", "reader"]
    assert app.app_state()["reader"] is app.reader


def test_private_untracked_reassigned_and_deleted_attributes_are_not_tracked() -> None:
    app = App()
    app._cache = Reader()
    app.eval_reader = Reader()
    app.reader = Reader()
    app.model = torch.nn.Linear(2, 1)
    app.model = None  # replaced by something stateless
    del app.reader
    assert app.app_state() == {}


def test_classes_are_not_tracked() -> None:
    app = App()
    app.kind = Reader  # has state_dict as an unbound function
    assert app.app_state() == {}


@pytest.mark.parametrize(
    "make, draw",
    [
        (lambda: random.Random(1), lambda g: [g.random() for _ in range(3)]),
        (lambda: np.random.default_rng(1), lambda g: g.random(3).tolist()),
        (lambda: torch.Generator().manual_seed(1), lambda g: torch.rand(3, generator=g).tolist()),
    ],
    ids=["random", "numpy", "torch"],
)
def test_generators_are_tracked_and_round_trip(make, draw) -> None:
    app = App()
    app.rng = make()
    state = app.app_state()["rng"]
    assert isinstance(state, GeneratorState)
    saved = state.state_dict()
    expected = draw(app.rng)
    draw(app.rng)
    state.load_state_dict(saved)
    assert draw(app.rng) == expected


def test_as_stateful_of_plain_values_is_none() -> None:
    assert as_stateful(3) is None
    assert as_stateful([1, 2]) is None
    reader = Reader()
    assert as_stateful(reader) is reader
