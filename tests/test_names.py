"""The one node-name rule and the one passwd lookup (slurm_ckpt.core.names), as the
node's own name (slurm_ckpt.slurm.env.this_node) uses them."""

from __future__ import annotations

import socket

import pytest

from slurm_ckpt.core.names import UserIds, node_name, user_ids
from slurm_ckpt.errors import InvalidName
from slurm_ckpt.slurm.env import this_node


def test_an_admins_node_name_is_validated_never_repaired() -> None:
    assert this_node("gpu-node17", environ={}) == "gpu-node17"
    with pytest.raises(InvalidName, match="invalid node name"):
        this_node("../etc", environ={})


def test_slurms_name_for_the_node_is_short_and_validated() -> None:
    assert this_node(environ={"SLURMD_NODENAME": "gpu7.cluster.example"}) == "gpu7"
    with pytest.raises(InvalidName):
        this_node(environ={"SLURMD_NODENAME": "bad name"})


def test_the_host_name_follows_the_one_rule_the_event_log_uses() -> None:
    assert this_node(environ={}) == node_name(socket.gethostname())
    assert node_name("gpu-node17.cluster.example") == "gpu-node17"
    assert node_name("..") == "localhost"


def test_one_passwd_lookup() -> None:
    assert user_ids("root") == UserIds("root", 0, 0)
    with pytest.raises(InvalidName, match="not known on this node"):
        user_ids("no-such-user-here")
    with pytest.raises(InvalidName):
        user_ids("../root")
