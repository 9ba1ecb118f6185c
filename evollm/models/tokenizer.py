"""Character-level tokenizer for the offline tiny model.

Every character of the alphabet is one token, so tokenization is lossless:
``tok.decode(tok.encode(s, add_special_tokens=False)) == s`` for any string
made of alphabet characters (spaces and newlines included).  The chat
template is a minimal role-tag format::

    <|system|>{content}<|user|>{content}<|assistant|>{content}<eos>

and ``add_generation_prompt=True`` appends a bare ``<|assistant|>``.

The tokenizer is a plain :class:`transformers.PreTrainedTokenizerFast`, so it
saves with ``save_pretrained`` and reloads with ``AutoTokenizer`` from a local
directory (no hub access needed).
"""

from __future__ import annotations

import hashlib
import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SYSTEM_TOKEN = "<|system|>"

#: Special tokens in id order (``<pad>`` is id 0).
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN)

#: Ordinary characters, each a single token.
ALPHABET = (
    string.digits
    + string.ascii_lowercase
    + string.ascii_uppercase
    + " \n\t"
    + "+-*/=?.,:;!()<>'\"_#[]{}|&%$@^~`\\"
)

#: Jinja chat template: messages are concatenated, each prefixed by its role tag;
#: assistant turns are closed by ``<eos>``.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{ '<|system|>' + message['content'] }}"
    "{%- elif message['role'] == 'user' -%}"
    "{{ '<|user|>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '<|assistant|>' + message['content'] + '<eos>' }}"
    "{%- else -%}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|assistant|>' }}"
    "{%- endif -%}"
)


def build_vocab() -> dict[str, int]:
    """Return the token -> id mapping: special tokens first, then the alphabet."""
    vocab: dict[str, int] = {}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    for ch in ALPHABET:
        if ch not in vocab:
            vocab[ch] = len(vocab)
    return vocab


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer with chat template and special tokens.

    Returns:
        A left-padding :class:`PreTrainedTokenizerFast` whose ``pad_token`` is
        ``<pad>`` (id 0), ``eos_token`` is ``<eos>`` and ``unk_token`` is
        ``<unk>``; ``<|user|>``, ``<|assistant|>`` and ``<|system|>`` are
        additional special tokens, each a single id.
    """
    vocab = build_vocab()
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Split into single characters, keeping every character (whitespace too).
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Concatenate tokens back with nothing in between.
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=256,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerFast | None = None) -> str:
    """Short hash of the tokenizer's full definition (vocab, pre-tokenizer, decoder, template).

    Use it in cache keys so that any change of the tokenizer invalidates
    artefacts built with an older one.
    """
    tok = tokenizer if tokenizer is not None else build_tokenizer()
    blob = tok.backend_tokenizer.to_str() + (tok.chat_template or "")
    return hashlib.sha256(blob.encode()).hexdigest()[:12]
