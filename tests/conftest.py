"""Shared fixtures: arenas in /dev/shm with unique names, removed after the test."""

import os
import uuid

import pytest

from hicached.arena import Arena


@pytest.fixture
def shm_path():
    path = f"/dev/shm/hicached-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield path
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@pytest.fixture
def arena(shm_path):
    a = Arena.create(shm_path, 1 << 20)
    yield a
    a.close()
