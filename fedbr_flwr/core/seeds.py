"""Named seed streams: every random draw of a run comes from a stream named here, derived from the run
seed and the stream's coordinates (round, partition, version). The numbers after the names are the
salts the streams have always used, so that runs repeat across versions of this code.

Two kinds: ``rng(name, seed, *coords)`` is a NumPy generator seeded by [seed, salt, *coords];
``seed(name, seed, *coords)`` is a 63-bit integer (sha256 of seed, coords, salt) for torch generators."""

from __future__ import annotations

import hashlib

import numpy as np

# NumPy streams: [seed, salt, *coords]
NUMPY_STREAMS = {
    "partition": 1,  # the label split
    "client-split": 2,  # a client's train / local-test split (coords: partition)
    "cifar-angle-prior": 3,  # RotatedCIFAR10: a client's angle prior (partition)
    "cifar-angles": 4,  # RotatedCIFAR10: its images' angles (partition)
    "global-test-angles": 5,  # retired (RotatedCIFAR10's global test had one drawn angle per image): never reuse
    "client-sampling": 6,  # clients sampled each round (round)
    "rsm-allotment": 7,  # how many RSM means each client contributes (version)
    "other-class-test": 8,  # one class per client: the other classes' test images added to its local test (partition)
    "extra-local-tests": 9,  # RotatedMNIST's extra local tests: the test split dealt into 10 sets
    "attackers": 10,  # attack-clients: which partitions attack
    "attack-noise": 11,  # attack=noise: an attacker's noise (round, partition)
    "attack-collusion": 12,  # attack=collude: the one noise every attacker sends (round)
}

# torch streams: sha256(seed, *coords, salt); None: no salt
TORCH_STREAMS = {
    "batches": None,  # a client's minibatches (round, partition)
    "rsm-means": 101,  # FedBR: a client's RSM means (version, partition)
    "fedbr-steps": 102,  # FedBR: Mixture's local samples per step (round, partition)
    "mixture-means": 103,  # FedBR: Mixture's proxy means (version)
    "mixup": 104,  # Mixup (strategy=mixup, GroupDRO's batches): lambda draws and permutations (round, partition)
    "fedmix-means": 105,  # FedMix: a client's mean data (version, partition)
    "fedmix-steps": 106,  # FedMix: means drawn per step (round, partition)
    "vhl-generator": 107,  # VHL: the untrained generator's weights
    "vhl-steps": 108,  # VHL: virtual samples drawn per step (round, partition)
    "vhl-data": 109,  # VHL: latents of the virtual data
    "distrans-offset": 201,  # DisTrans: a client's initial offset (partition)
}

# streams derived from another one: name -> (stream, offset added to its seed)
DERIVED = {
    "fedbr-mixup": ("fedbr-steps", 1),  # FedBR + Mixup: lambda and permutations (round, partition)
}

# fixed seeds that never depend on the run seed
MNIST5K_GLOBAL_TEST = 12345  # which 50 digits per class of mnist5k form the global test set
SYNTHETIC_DATA = 20260101  # the synthetic benchmark images and labels


def hash_seed(*parts: int) -> int:
    """A 63-bit seed from integers, the same in every process."""
    digest = hashlib.sha256(",".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def rng(name: str, seed: int, *coords: int) -> np.random.Generator:
    return np.random.default_rng([seed, NUMPY_STREAMS[name], *coords])


def seed(name: str, run_seed: int, *coords: int) -> int:
    if name in DERIVED:
        base, offset = DERIVED[name]
        return seed(base, run_seed, *coords) + offset
    salt = TORCH_STREAMS[name]
    return hash_seed(run_seed, *coords) if salt is None else hash_seed(run_seed, *coords, salt)


def torch_generator(name: str, run_seed: int, *coords: int, device=None):
    import torch

    generator = torch.Generator(device=device) if device is not None else torch.Generator()
    generator.manual_seed(seed(name, run_seed, *coords))
    return generator
