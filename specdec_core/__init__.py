"""specdec_core: the speculative decoding engine, pure PyTorch + transformers, no Ray and no I/O
beyond loading checkpoints.

Vocabulary (Leviathan et al. 2023, arXiv 2211.17192, Algorithm 1): p is the target's distribution,
q the draft's; a verify pass keeps the *accepted* draft tokens and adds one *recovered* token (at the
first rejection) or one *bonus* token (when all K were accepted).
"""

from specdec_core.acceptance import AcceptanceTracker, TrafficClass
from specdec_core.adaptive import AdaptiveK
from specdec_core.async_engine import AsyncEngine
from specdec_core.costmodel import CostModel
from specdec_core.engine import Engine
from specdec_core.kv_cache import KVWindow
from specdec_core.loading import check_same_tokenizer
from specdec_core.proposers import DraftModelProposer, NgramProposer, Proposal, ProposalRequest
from specdec_core.request import RequestOutput, RequestState, SamplingParams
from specdec_core.runner import ModelRunner
from specdec_core.sampling import process_logits, rejection_sample, sample_categorical
from specdec_core.stats import RequestStats, StepTiming
from specdec_core.step_costs import StepCosts
from specdec_core.verifier import Verifier, VerifyItem, VerifyResult

__all__ = [
    "AcceptanceTracker",
    "AdaptiveK",
    "AsyncEngine",
    "CostModel",
    "DraftModelProposer",
    "Engine",
    "KVWindow",
    "ModelRunner",
    "NgramProposer",
    "Proposal",
    "ProposalRequest",
    "RequestOutput",
    "RequestState",
    "RequestStats",
    "SamplingParams",
    "StepCosts",
    "StepTiming",
    "TrafficClass",
    "Verifier",
    "VerifyItem",
    "VerifyResult",
    "check_same_tokenizer",
    "process_logits",
    "rejection_sample",
    "sample_categorical",
]
