import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfc.runtime.data.tokenizer import CHAR_ORDER, CharTokenizer, HFTokenizer, load_tokenizer

PRINTABLE = string.ascii_letters + string.digits + string.punctuation + " "


def test_special_ids_and_layout():
    tok = CharTokenizer(98)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.encode("a") == [3] and tok.encode(" ") == [29] and tok.encode("0") == [30]
    assert tok.encode("ab", add_bos=True) == [1, 3, 4]
    assert sorted(CHAR_ORDER) == sorted(PRINTABLE)


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=PRINTABLE, max_size=40))
def test_full_vocab_roundtrips_printable_ascii(text):
    tok = CharTokenizer(98)
    ids = tok.encode(text)
    assert all(3 <= i < 98 for i in ids)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("vocab", [4, 30, 64, 96, 98, 200])
@settings(max_examples=50, deadline=None)
@given(text=st.text(max_size=30))
def test_ids_stay_in_vocab(vocab, text):
    tok = CharTokenizer(vocab)
    assert all(3 <= i < vocab for i in tok.encode(text))


def test_small_vocab_fallbacks():
    tok = CharTokenizer(96)  # 93 characters: '}' and '~' are dropped
    assert tok.decode(tok.encode("a}b~c")) == "a b c"
    tok = CharTokenizer(64)  # lowercase, space, digits, 11 marks, A..M
    assert tok.decode(tok.encode("Hello World!")) == "Hello world!"
    assert tok.decode(tok.encode("tab\there\nnew")) == "tab here new"
    tok = CharTokenizer(29)  # lowercase only: no space, unknowns are dropped
    assert tok.decode(tok.encode("Ab c9")) == "abc"


def test_decode_skips_specials_and_unused_ids():
    tok = CharTokenizer(120)
    assert tok.decode([1, 3, 2, 0, 110, 4]) == "ab"


def test_tiny_vocab_is_rejected():
    with pytest.raises(ValueError, match="vocab_size"):
        CharTokenizer(3)


def test_load_tokenizer_for_config_model():
    tok = load_tokenizer({"arch": "llama", "vocab": 64, "source": None})
    assert isinstance(tok, CharTokenizer) and tok.vocab_size == 64


def test_load_tokenizer_from_local_folder(tmp_path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for c in string.ascii_lowercase + " ":
        vocab[c] = len(vocab)
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(
        tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(tmp_path)

    tok = load_tokenizer({"source": str(tmp_path)})
    assert isinstance(tok, HFTokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 31)
    ids = tok.encode("hi there", add_bos=True)
    assert ids[0] == 1 and len(ids) == 9
    assert tok.decode(ids + [2, 0]) == "hi there"
