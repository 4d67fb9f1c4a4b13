"""Why a party rejected a message or stopped the round.

Every rejection is a specific subclass so that a transport (or a test) can tell a truncated
packet from a forgery from a replay. A party that raises one of these leaves its own state
exactly as it was before the message arrived: a rejected message never reaches the sum.
"""


class SecAggError(Exception):
    """Base class: the protocol refused a message or could not go on."""


class DecodeError(SecAggError):
    """The bytes are not a well-formed message (truncated, trailing bytes, bad magic,
    unknown version or type, a length out of range)."""


class RoundMismatchError(SecAggError):
    """The message belongs to another round: a replay from an earlier or later round."""


class MisaddressedError(SecAggError):
    """The message names another recipient."""


class UnexpectedMessageError(SecAggError):
    """The message type is not accepted in the party's current phase (too late, too early)."""


class UnknownSenderError(SecAggError):
    """The sender is not among those allowed to speak in this phase."""


class DuplicateMessageError(SecAggError):
    """The sender already delivered this phase's message; the first copy is kept."""


class AuthenticationError(SecAggError):
    """An AES-GCM tag or an Ed25519 signature does not verify, or a required one is missing."""


class ProtocolViolationError(SecAggError):
    """Well-formed and authentic, but inconsistent with the protocol (wrong share set, a
    survivor list that cannot be right, a vector of the wrong length, repeated public keys)."""


class ThresholdError(SecAggError):
    """Fewer than the threshold of parties are left: the round aborts without output."""


class ReconstructionError(SecAggError):
    """Shares reconstructed a secret that does not match its public key or commitment."""


class PolicyError(SecAggError):
    """The setup is weaker than the client's local policy, or its identity keys are not the
    ones pinned on the device: the client refuses to take part."""
