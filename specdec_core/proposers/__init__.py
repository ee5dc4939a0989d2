"""Proposers: where the K speculative tokens of a step come from."""

from specdec_core.proposers.base import Proposal, ProposalRequest, Proposer
from specdec_core.proposers.draft_model import DraftModelProposer
from specdec_core.proposers.ngram import NgramProposer

__all__ = ["DraftModelProposer", "NgramProposer", "Proposal", "ProposalRequest", "Proposer"]
