"""fastText's supervised prediction for many texts at once, in numpy, read from the same
``.ftz`` file (``FastTextBatchModel``): what ``core.language_id.LanguageIdentifier`` scores a
batch of sentences with."""

from __future__ import annotations

import struct
import threading
from pathlib import Path

import numpy as np

from core.languages import OTHER, SUPPORTED_LANGUAGES, UNDETERMINED

LABEL_PREFIX = len("__label__")
OUTCOMES = (*SUPPORTED_LANGUAGES, OTHER)
OUTCOME_INDEX = {code: i for i, code in enumerate(OUTCOMES)}


def outcome_index(code: str) -> int:
    """Index into OUTCOMES of a top language (any code outside them is OTHER); -1 for
    UNDETERMINED."""
    return -1 if code == UNDETERMINED else OUTCOME_INDEX.get(code, OUTCOME_INDEX[OTHER])


class FastTextBatchModel:
    """fastText's supervised prediction (``predict(text, k=1)``), re-implemented with numpy
    for many texts at once, reading the same ``.ftz`` file; tested to give fastText's label
    and (to ~1e-6) its probability.

    fastText's hidden vector for a line is the mean of the input-matrix rows of its tokens
    (each word's row if it is in the vocabulary, and the rows of its character n-grams)
    plus the end-of-line token; the label is found by hierarchical softmax over a Huffman
    tree. Here each distinct token's row sum and row count are computed once and cached,
    so a text costs a dictionary look-up per word and a few array operations per batch;
    fastText's C++ costs ~1 µs per word, every time.

    Only what ``lid.176`` uses is supported (quantised input, hierarchical softmax, no word
    n-grams); another model raises ``ValueError``. Thread-safe.
    """

    _MAGIC = 793712314
    _CACHE_LIMIT = 1 << 17
    """Distinct tokens kept (18 MiB); the cache is emptied when a batch would overflow it."""

    def __init__(self, path: Path) -> None:
        data = path.read_bytes()
        view = memoryview(data)
        magic, _version = struct.unpack_from("<ii", data, 0)
        args = struct.unpack_from("<12id", data, 8)
        offset = 8 + struct.calcsize("<12id")
        dim, word_ngrams, loss, bucket, minn, maxn = (args[i] for i in (0, 5, 6, 8, 9, 10))
        size, nwords, nlabels = struct.unpack_from("<3i", data, offset)
        prune_size = struct.unpack_from("<q", data, offset + 20)[0]
        offset += 28
        if magic != self._MAGIC or loss != 1 or word_ngrams != 1 or prune_size < 0:
            raise ValueError(
                f"{path}: not a pruned hierarchical-softmax fastText model without word "
                "n-grams (like lid.176.ftz); the batch identifier supports only those"
            )
        words: list[str] = []
        counts: list[int] = []
        for _ in range(size):
            end = data.index(b"\0", offset)
            words.append(data[offset:end].decode("utf-8"))
            counts.append(struct.unpack_from("<q", data, end + 1)[0])
            offset = end + 10  # int64 count, int8 type
        pairs = np.frombuffer(data, "<i4", 2 * prune_size, offset).reshape(-1, 2)
        offset += 8 * prune_size
        if not data[offset]:
            raise ValueError(f"{path}: the batch identifier needs a quantised (.ftz) model")
        rows, offset = _read_quantized_matrix(view, offset + 1)
        if data[offset]:
            output, offset = _read_quantized_matrix(view, offset + 1)
        else:
            m, n = struct.unpack_from("<2q", data, offset + 1)
            output = np.frombuffer(data, "<f4", m * n, offset + 17).reshape(m, n)
        self._rows = rows.astype(np.float64)
        self._nwords, self._bucket, self._minn, self._maxn = nwords, bucket, minn, maxn
        self._word_ids = {w: i for i, w in enumerate(words[:nwords])}
        self._pruned = dict(zip(pairs[:, 0].tolist(), pairs[:, 1].tolist(), strict=True))
        self._labels = [w[LABEL_PREFIX:] for w in words[nwords:]]
        self._outcome_of_label = np.array([outcome_index(label) for label in self._labels])
        self._output = np.ascontiguousarray(output[: nlabels - 1], dtype=np.float64)
        self._left, self._right, self._levels = _huffman_tree(counts[nwords:])
        nodes, self._path_right, self._path_starts = self._paths(
            [self._labels.index(code) for code in SUPPORTED_LANGUAGES]
        )
        self._path_output = np.ascontiguousarray(self._output[nodes].T)
        self._lock = threading.Lock()
        self._dim = dim
        self._clear_cache()

    def _clear_cache(self) -> None:
        # token -> column of _totals: the rows' sum (dim values) and their count (last value);
        # column 0 is the end of line, which ends every text (written as _LINE_END)
        self._token_index: dict[bytes, int] = {b"\x00": 0}
        self._totals = np.zeros((self._dim + 1, self._CACHE_LIMIT))
        self._totals[:-1, 0], self._totals[-1, 0] = self._rows[self._word_ids["</s>"]], 1.0

    def _token_rows(self, token: bytes) -> list[int]:
        """Input-matrix rows of one UTF-8 token (``Dictionary::getLine`` for a word, with
        ``computeSubwords`` for its character n-grams)."""
        if token.startswith(b"__label__"):
            return []  # fastText reads it as a label, not a word
        word_id = self._word_ids.get(token.decode("utf-8"), -1)
        rows = [word_id] if word_id >= 0 else []
        word = b"<" + token + b">"
        n = len(word)
        for i in range(n):
            if word[i] & 0xC0 == 0x80:
                continue  # n-grams start at a character, not inside one
            j, chars = i, 0
            while j < n and chars < self._maxn:
                j += 1
                while j < n and word[j] & 0xC0 == 0x80:
                    j += 1
                chars += 1
                if chars >= self._minn and not (chars == 1 and (i == 0 or j == n)):
                    row = self._pruned.get(_fnv1a(word[i:j]) % self._bucket)
                    if row is not None:
                        rows.append(self._nwords + row)
        return rows

    def _columns(self, tokens: list[bytes]) -> np.ndarray:
        """Cache column of each token, adding the tokens not yet cached."""
        index = self._token_index
        try:
            return np.fromiter(map(index.__getitem__, tokens), np.intp, len(tokens))
        except KeyError:
            pass
        new = set(tokens).difference(index)
        if len(index) + len(new) > self._CACHE_LIMIT:
            self._clear_cache()
            index = self._token_index
            new = set(tokens).difference(index)
        needed = len(index) + len(new)
        if needed > self._totals.shape[1]:  # one batch with more new words than the limit
            grown = np.zeros((self._totals.shape[0], needed))
            grown[:, : len(index)] = self._totals[:, : len(index)]
            self._totals = grown
        for token in new:
            rows = self._token_rows(token)
            column = len(index)
            self._totals[:-1, column] = self._rows[rows].sum(axis=0)
            self._totals[-1, column] = len(rows)
            index[token] = column
        return np.fromiter(map(index.__getitem__, tokens), np.intp, len(tokens))

    def _hidden(self, texts: list[str]) -> np.ndarray:
        """fastText's hidden vector of each one-line text (without the token ``</s>``)."""
        # fastText splits UTF-8 bytes at the ASCII spaces that bytes.split() splits at, and
        # at NUL (made a space here); lone surrogates become "?" as in ``_top``.
        joined = (_LINE_END.join(texts) + _LINE_END).encode("utf-8", errors="replace")
        if joined.count(b"\x00") != len(texts):
            end = _LINE_END.encode()
            parts = (t.encode("utf-8", errors="replace").replace(b"\x00", b" ") for t in texts)
            joined = end.join(parts) + end
        tokens = joined.split()
        with self._lock:
            columns = self._columns(tokens)
            ends = np.flatnonzero(columns == 0)  # each text's tokens end with its end of line
            starts = np.concatenate(([0], ends[:-1] + 1))
            totals = np.add.reduceat(self._totals.take(columns, axis=1), starts, axis=1)
        return np.ascontiguousarray((totals[:-1] / totals[-1]).T)

    def top_many(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """fastText's top label (as an index into OUTCOMES) and its probability for each
        one-line text (without the token ``</s>``, after which fastText stops reading)."""
        if not texts:
            return np.zeros(0, np.intp), np.zeros(0)
        hidden = self._hidden(texts)
        best, scores = self._greedy_leaves(hidden)
        # The greedy leaf is the best one when it holds more than half of the probability
        # (which sums to at most 1.0035 with fastText's 1e-5 smoothing); check the others.
        unsure = np.flatnonzero(scores <= _LOG_MAJORITY)
        if unsure.size:
            leaf_scores = self._leaf_scores(hidden[unsure] @ self._output.T)
            best[unsure] = leaf_scores.argmax(axis=1)
            scores[unsure] = leaf_scores[np.arange(unsure.size), best[unsure]]
        return self._outcome_of_label[best], np.exp(scores)

    def distributions(self, texts: list[str]) -> np.ndarray:
        """fastText's probability of each of OUTCOMES for each one-line text (without the
        token ``</s>``); see ``with_other``. Only the tree nodes on the paths to the
        supported languages' leaves are evaluated."""
        if not texts:
            return np.zeros((0, len(OUTCOMES)))
        logits = self._hidden(texts) @ self._path_output
        p_right = 1.0 / (1.0 + np.exp(-logits))
        steps = np.log(np.where(self._path_right, p_right, 1.0 - p_right) + 1e-5)
        probs = np.exp(np.add.reduceat(steps, self._path_starts, axis=1))
        return with_other(np.where(probs >= MIN_LABEL_PROBABILITY, probs, 0.0))

    def _paths(self, leaves: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For the root-to-leaf paths of ``leaves``, concatenated: each step's node (as a
        row of ``_output``) and whether it goes right, and where each leaf's steps start."""
        n = len(self._labels)
        parent = {
            int(c): (p, side)
            for p in range(n, 2 * n - 1)
            for side, c in ((False, self._left[p]), (True, self._right[p]))
        }
        nodes: list[int] = []
        signs: list[bool] = []
        starts: list[int] = []
        for leaf in leaves:
            starts.append(len(nodes))
            node = leaf
            while node in parent:
                node, right = parent[node]
                nodes.append(node - n)
                signs.append(right)
        return np.array(nodes), np.array(signs), np.array(starts)

    def _greedy_leaves(self, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Leaf reached from the root by always taking the likelier branch, and its log
        probability, for each hidden vector (no BLAS: its threads cost more than they save
        on these small products)."""
        n = len(self._labels)
        rows = np.arange(len(hidden))
        node = np.full(len(hidden), 2 * n - 2)
        score = np.zeros(len(hidden))
        while rows.size:
            here = node[rows]
            x = np.einsum("ij,ij->i", hidden[rows], self._output[here - n])
            right = x > 0
            p_right = 1.0 / (1.0 + np.exp(-x))
            score[rows] += np.log(np.where(right, p_right, 1.0 - p_right) + 1e-5)
            here = np.where(right, self._right[here], self._left[here])
            node[rows] = here
            rows = rows[here >= n]
        return node, score

    def _leaf_scores(self, logits: np.ndarray) -> np.ndarray:
        """Log probability of every leaf (label) for each row of node logits."""
        n = len(self._labels)
        scores = np.zeros((len(logits), 2 * n - 1))
        for parents in self._levels:
            p_right = 1.0 / (1.0 + np.exp(-logits[:, parents - n]))
            above = scores[:, parents]
            scores[:, self._left[parents]] = above + np.log(1.0 - p_right + 1e-5)
            scores[:, self._right[parents]] = above + np.log(p_right + 1e-5)
        return scores[:, :n]


_LINE_END = " \x00 "
"""Ends each text of a batch, as a token of its own (texts' own NULs become spaces)."""

_LOG_MAJORITY = float(np.log(0.502))


MIN_LABEL_PROBABILITY = 1e-4
"""Supported languages less likely than this count as 0 in fastText's distribution: fastText's
C++ then prunes most of the tree (5 µs a call instead of 50), and the numpy path cuts the same
labels; against PRIOR_FLOOR (1e-3) the difference is at most 0.1 nat."""

SUPPORTED_LABEL_INDEX = {f"__label__{code}": i for i, code in enumerate(SUPPORTED_LANGUAGES)}


def with_other(supported: np.ndarray) -> np.ndarray:
    """Rows of probabilities of the supported languages, with OTHER appended as the rest of
    1 (not as the sum of the other labels: fastText's C++ leaves out the labels it prunes, and
    its smoothing makes all labels sum to up to 1.0035, which would make the two paths
    differ)."""
    other = np.maximum(1.0 - supported.sum(axis=1, keepdims=True), 0.0)
    return np.concatenate((supported, other), axis=1)


def _fnv1a(data: bytes) -> int:
    """fastText's 32-bit FNV-1a hash (it sign-extends bytes >= 0x80)."""
    h = 2166136261
    for byte in data:
        h = ((h ^ (byte | 0xFFFFFF00 if byte >= 0x80 else byte)) * 16777619) & 0xFFFFFFFF
    return h


def _read_quantized_matrix(view: memoryview, offset: int) -> tuple[np.ndarray, int]:
    """A fastText ``QuantMatrix`` (product-quantised rows, optionally quantised norms),
    decoded to a dense float32 matrix; returns it and the offset after it."""
    qnorm = view[offset]
    m, n = struct.unpack_from("<2q", view, offset + 1)
    code_size = struct.unpack_from("<i", view, offset + 17)[0]
    codes = np.frombuffer(view, np.uint8, code_size, offset + 21)
    (dim, nsubq, dsub, lastdsub, centroids), offset = _read_product_quantizer(
        view, offset + 21 + code_size
    )
    codes = codes.reshape(m, nsubq)
    rows = np.empty((m, dim), np.float32)
    for q in range(nsubq):
        width = lastdsub if q == nsubq - 1 else dsub
        table = centroids[q * 256 * dsub : q * 256 * dsub + 256 * width].reshape(256, width)
        rows[:, q * dsub : q * dsub + width] = table[codes[:, q]]
    if qnorm:
        norm_codes = np.frombuffer(view, np.uint8, m, offset)
        (*_, norms), offset = _read_product_quantizer(view, offset + m)
        rows *= norms[norm_codes][:, None]
    return rows, offset


def _read_product_quantizer(view: memoryview, offset: int) -> tuple[tuple, int]:
    dim, nsubq, dsub, lastdsub = struct.unpack_from("<4i", view, offset)
    centroids = np.frombuffer(view, "<f4", dim * 256, offset + 16)
    return (dim, nsubq, dsub, lastdsub, centroids), offset + 16 + 4 * dim * 256


def _huffman_tree(label_counts: list[int]) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """fastText's hierarchical-softmax tree (``HierarchicalSoftmaxLoss::buildTree``): left
    and right child of each node (leaves are ``0..n-1``, the root ``2n-2``) and the internal
    nodes grouped by depth, root first."""
    n = len(label_counts)
    count = [*label_counts, *[10**15] * (n - 1)]
    left = np.full(2 * n - 1, -1)
    right = np.full(2 * n - 1, -1)
    leaf, node = n - 1, n
    for i in range(n, 2 * n - 1):
        pair = []
        for _ in range(2):
            if leaf >= 0 and count[leaf] < count[node]:
                pair.append(leaf)
                leaf -= 1
            else:
                pair.append(node)
                node += 1
        count[i] = count[pair[0]] + count[pair[1]]
        left[i], right[i] = pair
    levels: list[np.ndarray] = []
    level = [2 * n - 2]
    while level:
        levels.append(np.array(level))
        level = [c for p in level for c in (left[p], right[p]) if c >= n]
    return left, right, levels
