"""Collectives over torch.distributed; nothing here knows about algorithms."""

from hexagram.comm.communicator import ByteCounter, Communicator, Deferred, Handle
from hexagram.comm.peers import PEER_SELECTIONS, select_peers

__all__ = ["PEER_SELECTIONS", "ByteCounter", "Communicator", "Deferred", "Handle",
           "select_peers"]
