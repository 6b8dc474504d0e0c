//! Test support: a tiny randomly-initialised Llama model written to disk in both Hugging Face
//! (safetensors + config + tokenizer) and GGUF form, for fast mechanics tests. Deterministic:
//! the same seed writes the same bytes. Real-model behaviour is tested on the default model.

use anyhow::Result;
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Shape of the tiny model.
#[derive(Clone, Debug)]
pub struct TinySpec {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub max_positions: usize,
    pub qkv_bias: bool,
    pub seed: u64,
    /// Vocabulary size: 0 for the tiny byte vocabulary alone; more pads it with filler tokens
    /// that the tokenizer never produces (a model of a real vocabulary's shape, for benchmarks).
    pub vocab: usize,
}

impl Default for TinySpec {
    fn default() -> Self {
        Self { hidden: 64, intermediate: 128, layers: 2, heads: 4, kv_heads: 2, max_positions: 2048, qkv_bias: false, seed: 42, vocab: 0 }
    }
}

impl TinySpec {
    /// A randomly initialised model of SmolLM2-135M's exact shapes (the default model's), its
    /// vocabulary size included: timings of every matmul, attention and the LM head match the
    /// real model's where its weights cannot travel (a GPU machine without the model file).
    pub fn smollm2_135m_shaped() -> Self {
        let c = smollm2_135m_config();
        Self {
            hidden: c.hidden_size,
            intermediate: c.intermediate_size,
            layers: c.num_layers,
            heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            max_positions: c.max_position_embeddings,
            qkv_bias: false,
            seed: 42,
            vocab: c.vocab_size,
        }
    }

    /// Random weights of Qwen2.5-0.5B's shapes (biased q/k/v, 14 query and 2 KV heads, its
    /// 151,936-entry vocabulary): what a deployment-size model costs, for benchmarks.
    pub fn qwen2_5_0_5b_shaped() -> Self {
        Self { hidden: 896, intermediate: 4864, layers: 24, heads: 14, kv_heads: 2, max_positions: 32768, qkv_bias: true, seed: 42, vocab: 151_936 }
    }

    /// Random weights of Llama-3.2-1B's shapes (16 layers, 32 query and 8 KV heads of 64, its
    /// 128,256-entry vocabulary), for benchmarks.
    pub fn llama_3_2_1b_shaped() -> Self {
        Self { hidden: 2048, intermediate: 8192, layers: 16, heads: 32, kv_heads: 8, max_positions: 32768, qkv_bias: false, seed: 42, vocab: 128_256 }
    }

    /// The vocabulary: the tiny byte vocabulary, padded to `vocab` entries if that is larger.
    pub fn vocabulary(&self) -> Vec<String> {
        let mut v = tiny_vocab();
        let n = v.len();
        v.extend((n..self.vocab).map(|i| format!("<|filler_{i}|>")));
        v
    }
}

/// The default model's configuration (SmolLM2-135M), for size computations in tests.
pub fn smollm2_135m_config() -> crate::model::ModelConfig {
    crate::model::ModelConfig {
        architecture: crate::model::Architecture::Llama,
        vocab_size: 49152,
        hidden_size: 576,
        intermediate_size: 1536,
        num_layers: 30,
        num_heads: 9,
        num_kv_heads: 3,
        head_dim: 64,
        rms_norm_eps: 1e-5,
        rope_theta: 100000.0,
        rope_scaling: None,
        max_position_embeddings: 8192,
        tie_word_embeddings: true,
        attention_bias: false,
        sliding_window: None,
    }
}

pub const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

pub use crate::adapters::init::Rng;

/// GPT-2's byte → printable-character map used by byte-level BPE vocabularies.
pub fn byte_to_char() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut extra = 0;
    for b in 0u32..256 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + extra);
            extra += 1;
        }
    }
    let mut map = vec![' '; 256];
    for (b, c) in printable.iter().zip(chars) {
        map[*b as usize] = char::from_u32(c).expect("valid char");
    }
    map
}

/// Vocabulary: the 3 special tokens, then the 256 byte tokens (no merges: one token per byte).
pub fn tiny_vocab() -> Vec<String> {
    let mut v: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    v.extend(byte_to_char().into_iter().map(|c| c.to_string()));
    v
}

fn tensors(spec: &TinySpec) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut rng = Rng::new(spec.seed);
    let vocab = spec.vocabulary().len();
    let hd = spec.hidden / spec.heads;
    let (h, i) = (spec.hidden, spec.intermediate);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![vocab, h], rng.vec(vocab * h, 0.5))];
    let lin = |rng: &mut Rng, o: usize, inn: usize| rng.vec(o * inn, 1.0 / (inn as f32).sqrt());
    for l in 0..spec.layers {
        let p = format!("model.layers.{l}");
        let norm = |rng: &mut Rng| (0..h).map(|_| 1.0 + 0.1 * rng.next_f32()).collect::<Vec<_>>();
        out.push((format!("{p}.input_layernorm.weight"), vec![h], norm(&mut rng)));
        out.push((format!("{p}.self_attn.q_proj.weight"), vec![spec.heads * hd, h], lin(&mut rng, spec.heads * hd, h)));
        out.push((format!("{p}.self_attn.k_proj.weight"), vec![spec.kv_heads * hd, h], lin(&mut rng, spec.kv_heads * hd, h)));
        out.push((format!("{p}.self_attn.v_proj.weight"), vec![spec.kv_heads * hd, h], lin(&mut rng, spec.kv_heads * hd, h)));
        if spec.qkv_bias {
            out.push((format!("{p}.self_attn.q_proj.bias"), vec![spec.heads * hd], rng.vec(spec.heads * hd, 0.1)));
            out.push((format!("{p}.self_attn.k_proj.bias"), vec![spec.kv_heads * hd], rng.vec(spec.kv_heads * hd, 0.1)));
            out.push((format!("{p}.self_attn.v_proj.bias"), vec![spec.kv_heads * hd], rng.vec(spec.kv_heads * hd, 0.1)));
        }
        out.push((format!("{p}.self_attn.o_proj.weight"), vec![h, spec.heads * hd], lin(&mut rng, h, spec.heads * hd)));
        out.push((format!("{p}.post_attention_layernorm.weight"), vec![h], norm(&mut rng)));
        out.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h], lin(&mut rng, i, h)));
        out.push((format!("{p}.mlp.up_proj.weight"), vec![i, h], lin(&mut rng, i, h)));
        out.push((format!("{p}.mlp.down_proj.weight"), vec![h, i], lin(&mut rng, h, i)));
    }
    out.push(("model.norm.weight".to_string(), vec![h], vec![1.0; h]));
    out
}

/// Writes the tiny model as a Hugging Face directory; returns `dir`.
pub fn write_hf(dir: &Path, spec: &TinySpec) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let dev = Device::Cpu;
    let mut map: HashMap<String, Tensor> = HashMap::new();
    for (name, shape, data) in tensors(spec) {
        map.insert(name, Tensor::from_vec(data, shape, &dev)?);
    }
    candle_core::safetensors::save(&map, dir.join("model.safetensors"))?;
    let vocab = spec.vocabulary().len();
    let arch = if spec.qkv_bias { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" };
    let config = serde_json::json!({
        "architectures": [arch],
        "vocab_size": vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": spec.max_positions,
        "tie_word_embeddings": true,
        "attention_bias": spec.qkv_bias,
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json_of(&spec.vocabulary()))?;
    let tcfg = serde_json::json!({
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": false,
        "chat_template": CHATML_TEMPLATE,
    });
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_string_pretty(&tcfg)?)?;
    Ok(dir.to_path_buf())
}

/// The tiny model's `tokenizer.json`: byte-level BPE, one token per byte, ChatML specials.
pub fn tokenizer_json() -> String {
    tokenizer_json_of(&tiny_vocab())
}

/// A byte-level BPE tokenizer over `vocab` (the tiny vocabulary first), no merges.
fn tokenizer_json_of(vocab: &[String]) -> String {
    let vocab: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, t)| (t, serde_json::Value::from(i)))
        .collect();
    let added: Vec<serde_json::Value> = SPECIALS
        .iter()
        .enumerate()
        .map(|(i, s)| {
            serde_json::json!({"id": i, "content": s, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    })
    .to_string()
}

/// Writes the same tiny model as a llama-architecture GGUF file (q/k rows permuted the way
/// llama.cpp's converter does), with weights stored as `dtype` (norms stay F32).
pub fn write_gguf(path: &Path, spec: &TinySpec, dtype: GgmlDType) -> Result<PathBuf> {
    let dev = Device::Cpu;
    let hd = spec.hidden / spec.heads;
    let mut qtensors: Vec<(String, QTensor)> = Vec::new();
    for (name, shape, data) in tensors(spec) {
        let gname = gguf_name(&name);
        let is_norm = name.ends_with("norm.weight") || name.ends_with(".bias");
        // llama.cpp permutes q/k rows of llama-architecture models only (not qwen2).
        let permute = !spec.qkv_bias;
        let data = if permute && name.ends_with("q_proj.weight") {
            crate::model::gguf::permute_rows_for_gguf(&data, shape[0], shape[1], spec.heads)
        } else if permute && name.ends_with("k_proj.weight") {
            crate::model::gguf::permute_rows_for_gguf(&data, shape[0], shape[1], spec.kv_heads)
        } else {
            data
        };
        let t = Tensor::from_vec(data, shape, &dev)?;
        let q = if is_norm { QTensor::quantize(&t, GgmlDType::F32)? } else { QTensor::quantize(&t, dtype)? };
        qtensors.push((gname, q));
    }
    use gguf_file::Value as V;
    let vocab = spec.vocabulary();
    let arch = if spec.qkv_bias { "qwen2" } else { "llama" };
    let md: Vec<(String, V)> = vec![
        ("general.architecture".into(), V::String(arch.into())),
        ("general.name".into(), V::String("tiny".into())),
        (format!("{arch}.block_count"), V::U32(spec.layers as u32)),
        (format!("{arch}.embedding_length"), V::U32(spec.hidden as u32)),
        (format!("{arch}.feed_forward_length"), V::U32(spec.intermediate as u32)),
        (format!("{arch}.attention.head_count"), V::U32(spec.heads as u32)),
        (format!("{arch}.attention.head_count_kv"), V::U32(spec.kv_heads as u32)),
        (format!("{arch}.attention.layer_norm_rms_epsilon"), V::F32(1e-5)),
        (format!("{arch}.rope.freq_base"), V::F32(10000.0)),
        (format!("{arch}.context_length"), V::U32(spec.max_positions as u32)),
        (format!("{arch}.rope.dimension_count"), V::U32(hd as u32)),
        ("tokenizer.ggml.model".into(), V::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), V::String("default".into())),
        ("tokenizer.ggml.tokens".into(), V::Array(vocab.iter().map(|t| V::String(t.clone())).collect())),
        (
            "tokenizer.ggml.token_type".into(),
            V::Array((0..vocab.len()).map(|i| V::I32(if i < SPECIALS.len() { 3 } else { 1 })).collect()),
        ),
        ("tokenizer.ggml.merges".into(), V::Array(vec![])),
        ("tokenizer.ggml.eos_token_id".into(), V::U32(2)),
        ("tokenizer.ggml.padding_token_id".into(), V::U32(0)),
        ("tokenizer.ggml.add_bos_token".into(), V::Bool(false)),
        ("tokenizer.chat_template".into(), V::String(CHATML_TEMPLATE.into())),
    ];
    let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = qtensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path)?;
    gguf_file::write(&mut f, &md_refs, &t_refs)?;
    Ok(path.to_path_buf())
}

fn gguf_name(hf: &str) -> String {
    if hf == "model.embed_tokens.weight" {
        return "token_embd.weight".into();
    }
    if hf == "model.norm.weight" {
        return "output_norm.weight".into();
    }
    let rest = hf.strip_prefix("model.layers.").unwrap_or(hf);
    let (layer, tail) = rest.split_once('.').unwrap_or((rest, ""));
    let t = tail
        .replace("self_attn.q_proj", "attn_q")
        .replace("self_attn.k_proj", "attn_k")
        .replace("self_attn.v_proj", "attn_v")
        .replace("self_attn.o_proj", "attn_output")
        .replace("mlp.gate_proj", "ffn_gate")
        .replace("mlp.up_proj", "ffn_up")
        .replace("mlp.down_proj", "ffn_down")
        .replace("post_attention_layernorm", "ffn_norm")
        .replace("input_layernorm", "attn_norm");
    format!("blk.{layer}.{t}")
}

/// What a test PDF holds.
#[derive(Clone, Copy)]
pub enum PdfPages<'a> {
    /// One page per entry, each line of it drawn as text (Helvetica).
    Text(&'a [&'a str]),
    /// One page with only a picture on it: no text layer (a scan).
    ImageOnly,
    /// One page per entry, the entry its content stream as written, uncompressed (Helvetica is
    /// `/F1`): for operators the other variants do not use.
    Content(&'a [&'a str]),
    /// As `Content`, but `/F1` is a CID font (Type 0, Identity-H, no embedded program) whose
    /// two-byte codes 1 to 26 are `a` to `z` through a ToUnicode map, all 500 units wide given as
    /// one width range (`1 26 500`) with a default width of 0, as browsers write them.
    CidContent(&'a [&'a str]),
}

/// A small real PDF, written with lopdf: pages of text (or an image-only page), a `Title` in its
/// information dictionary, and, with `user_password`, encrypted (RC4, 128-bit; an empty user
/// password with an owner password makes an "owner-locked" PDF that opens without one).
pub fn write_pdf(pages: PdfPages, title: &str, user_password: Option<&str>) -> Result<Vec<u8>> {
    pdf_document(pages, title, user_password, false)
}

/// As [`write_pdf`] (unencrypted), saved as PDF 1.5 writers do: its objects packed into object
/// streams behind a cross-reference stream.
pub fn write_pdf_with_object_streams(pages: PdfPages, title: &str) -> Result<Vec<u8>> {
    pdf_document(pages, title, None, true)
}

fn pdf_document(pages: PdfPages, title: &str, user_password: Option<&str>, object_streams: bool) -> Result<Vec<u8>> {
    use lopdf::content::{Content, Operation};
    use lopdf::{dictionary, Document, Object, Stream};
    let mut doc = Document::with_version("1.5");
    let pages_id = doc.new_object_id();
    let font_id = if let PdfPages::CidContent(_) = pages {
        let cmap = "/CIDInit /ProcSet findresource begin 12 dict begin begincmap /CMapName /T def /CMapType 2 def \
            1 begincodespacerange <0000> <FFFF> endcodespacerange 1 beginbfrange <0001> <001A> <0061> endbfrange \
            endcmap CMapName currentdict /CMap defineresource pop end end";
        let to_unicode = doc.add_object(Stream::new(dictionary! {}, cmap.as_bytes().to_vec()));
        let descriptor = doc.add_object(dictionary! {"Type" => "FontDescriptor", "FontName" => "Test", "Flags" => 32,
            "FontBBox" => vec![0.into(), 0.into(), 500.into(), 700.into()], "ItalicAngle" => 0, "Ascent" => 700,
            "Descent" => 0, "CapHeight" => 700, "StemV" => 80});
        let cid_font = doc.add_object(dictionary! {"Type" => "Font", "Subtype" => "CIDFontType2", "BaseFont" => "Test",
            "CIDSystemInfo" => dictionary! {"Registry" => Object::string_literal("Adobe"), "Ordering" => Object::string_literal("Identity"), "Supplement" => 0},
            "FontDescriptor" => descriptor, "CIDToGIDMap" => "Identity", "DW" => 0,
            "W" => vec![1.into(), 26.into(), 500.into()]});
        doc.add_object(dictionary! {"Type" => "Font", "Subtype" => "Type0", "BaseFont" => "Test", "Encoding" => "Identity-H",
            "DescendantFonts" => vec![cid_font.into()], "ToUnicode" => to_unicode})
    } else {
        doc.add_object(dictionary! {"Type" => "Font", "Subtype" => "Type1", "BaseFont" => "Helvetica"})
    };
    let mut image_id = None;
    let compress = !matches!(pages, PdfPages::Content(_) | PdfPages::CidContent(_));
    let contents: Vec<Vec<Operation>> = match pages {
        PdfPages::Content(_) | PdfPages::CidContent(_) => vec![],
        PdfPages::Text(texts) => texts
            .iter()
            .map(|text| {
                let mut ops = vec![
                    Operation::new("BT", vec![]),
                    Operation::new("Tf", vec!["F1".into(), 11.into()]),
                    Operation::new("TL", vec![14.into()]),
                    Operation::new("Td", vec![72.into(), 770.into()]),
                ];
                for line in text.lines() {
                    ops.push(Operation::new("Tj", vec![Object::string_literal(line)]));
                    ops.push(Operation::new("T*", vec![]));
                }
                ops.push(Operation::new("ET", vec![]));
                ops
            })
            .collect(),
        PdfPages::ImageOnly => {
            // An 8x8 grey gradient, drawn over most of the page.
            let pixels: Vec<u8> = (0..64u8).map(|i| i * 4).collect();
            let image = Stream::new(
                dictionary! {"Type" => "XObject", "Subtype" => "Image", "Width" => 8, "Height" => 8,
                             "ColorSpace" => "DeviceGray", "BitsPerComponent" => 8},
                pixels,
            );
            image_id = Some(doc.add_object(image));
            vec![vec![
                Operation::new("q", vec![]),
                Operation::new("cm", vec![400.into(), 0.into(), 0.into(), 600.into(), 100.into(), 100.into()]),
                Operation::new("Do", vec!["Im1".into()]),
                Operation::new("Q", vec![]),
            ]]
        }
    };
    let mut resources = dictionary! {"Font" => dictionary! {"F1" => font_id}};
    if let Some(id) = image_id {
        resources.set("XObject", dictionary! {"Im1" => id});
    }
    let resources_id = doc.add_object(resources);
    let mut kids = Vec::new();
    let mut streams = contents.into_iter().map(|operations| Content { operations }.encode()).collect::<Result<Vec<_>, _>>()?;
    if let PdfPages::Content(raw) | PdfPages::CidContent(raw) = pages {
        streams = raw.iter().map(|c| c.as_bytes().to_vec()).collect();
    }
    for stream in streams {
        let content_id = doc.add_object(Stream::new(dictionary! {}, stream).with_compression(false));
        kids.push(Object::from(doc.add_object(dictionary! {"Type" => "Page", "Parent" => pages_id, "Contents" => content_id})));
    }
    let count = kids.len() as i64;
    let pages = dictionary! {"Type" => "Pages", "Kids" => kids, "Count" => count, "Resources" => resources_id,
                             "MediaBox" => vec![0.into(), 0.into(), 612.into(), 792.into()]};
    doc.objects.insert(pages_id, Object::Dictionary(pages));
    let catalog_id = doc.add_object(dictionary! {"Type" => "Catalog", "Pages" => pages_id});
    let info_id = doc.add_object(dictionary! {"Title" => Object::string_literal(title)});
    doc.trailer.set("Root", catalog_id);
    doc.trailer.set("Info", info_id);
    doc.trailer.set("ID", vec![Object::string_literal("lift-serve-test-0"), Object::string_literal("lift-serve-test-0")]);
    if compress {
        doc.compress();
    }
    if let Some(user) = user_password {
        let version = lopdf::EncryptionVersion::V2 {
            document: &doc,
            owner_password: "owner-secret",
            user_password: user,
            key_length: 128,
            permissions: lopdf::Permissions::all(),
        };
        let state = lopdf::EncryptionState::try_from(version)?;
        doc.encrypt(&state)?;
    }
    let mut out = Vec::new();
    if object_streams {
        doc.save_modern(&mut out)?;
    } else {
        doc.save_to(&mut out)?;
    }
    Ok(out)
}

/// A throwaway PostgreSQL cluster for tests and benches (`scripts/pg_cluster.sh`: the
/// distribution's PostgreSQL, a temporary directory, a free port on 127.0.0.1), destroyed when
/// dropped.
pub struct PgCluster {
    dir: tempfile::TempDir,
    /// `postgres://postgres@127.0.0.1:<port>/lift`
    pub url: String,
}

impl PgCluster {
    pub fn start() -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("lift-pg-").tempdir()?;
        let url = pg_cluster("start", dir.path())?;
        Ok(Self { dir, url })
    }

    /// Stops the server (`fast`: clients are disconnected); [`PgCluster::restart`] brings it back
    /// on the same port with the same data.
    pub fn stop(&self) -> Result<()> {
        pg_cluster("stop", self.dir.path()).map(drop)
    }

    pub fn restart(&self) -> Result<()> {
        let url = pg_cluster("start", self.dir.path())?;
        anyhow::ensure!(url == self.url, "the cluster came back at {url}, not {}", self.url);
        Ok(())
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if let Err(e) = pg_cluster("destroy", self.dir.path()) {
            eprintln!("cannot destroy the test cluster: {e:#}");
        }
    }
}

fn pg_cluster(command: &str, dir: &Path) -> Result<String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/pg_cluster.sh");
    let out = std::process::Command::new(&script).arg(command).arg(dir).output()?;
    anyhow::ensure!(
        out.status.success(),
        "{} {command}: {}\n{}",
        script.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// An absorb checkpoint kept in memory (tests of resumable absorbs); clones share it.
#[derive(Clone, Default)]
pub struct MemoryCheckpoint(pub std::rc::Rc<std::cell::RefCell<Option<Vec<u8>>>>);

impl crate::lift::checkpoint::CheckpointStore for MemoryCheckpoint {
    fn load(&self) -> Result<Option<Vec<u8>>> {
        Ok(self.0.borrow().clone())
    }
    fn save(&self, bytes: Vec<u8>) -> Result<()> {
        *self.0.borrow_mut() = Some(bytes);
        Ok(())
    }
}

/// Holding an engine thread with the model idle: what a test posts meanwhile stays queued, so a
/// queue fills (or a document stays unstarted) deterministically. The hold takes a place in the
/// lane's queue like a job, then counts as the lane's running job until `until`'s sender is dropped.
impl crate::engine::Engine {
    pub fn hold_training(&self, until: std::sync::mpsc::Receiver<()>) -> Result<(), crate::engine::EngineError> {
        self.train.call(move || while until.recv().is_ok() {})
    }

    pub fn hold_generation(&self, until: std::sync::mpsc::Receiver<()>) -> Result<(), crate::engine::EngineError> {
        self.gen.call(move || while until.recv().is_ok() {})
    }
}

/// The tiny model and absorb options of the server tests in `dir`: `(model directory, options
/// file)`. The options train in a fraction of a second (window 32, one epoch each, 2–4 extractive
/// QA pairs).
pub fn write_tiny_server_setup(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    let model = write_hf(&dir.join("tiny"), &TinySpec::default())?;
    let options = dir.join("absorb.json");
    let json = serde_json::json!({"plan": {"window": 32, "context_tokens": 16},
                                  "train": {"epochs": [1, 1]},
                                  "qa": {"use_model": false, "max_pairs": 4, "min_pairs": 2}});
    std::fs::write(&options, json.to_string())?;
    Ok((model, options))
}

/// Small real Word, OpenDocument and EPUB files, packaged with the zip crate as their writers
/// package them (an ODF's or EPUB's `mimetype` first and stored).
pub mod packages {
    use std::io::Write;

    /// A ZIP of these members, in order; a member named `mimetype` is stored, the rest deflated.
    pub fn zip(members: &[(&str, &[u8])]) -> Vec<u8> {
        use zip::write::SimpleFileOptions;
        let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
        for (name, data) in members {
            let method = if *name == "mimetype" { zip::CompressionMethod::Stored } else { zip::CompressionMethod::Deflated };
            w.start_file(*name, SimpleFileOptions::default().compression_method(method)).unwrap();
            w.write_all(data).unwrap();
        }
        w.finish().unwrap().into_inner()
    }

    /// A `.docx` whose body is `body` (the `w:body` element's content) and, when given, whose
    /// `docProps/core.xml` has that title.
    pub fn docx(body: &str, title: Option<&str>) -> Vec<u8> {
        let document = format!(
            r#"<?xml version="1.0" encoding="UTF-8" standalone="yes"?><w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"><w:body>{body}</w:body></w:document>"#
        );
        let core = title.map(|t| {
            format!(r#"<?xml version="1.0"?><cp:coreProperties xmlns:cp="http://schemas.openxmlformats.org/package/2006/metadata/core-properties" xmlns:dc="http://purl.org/dc/elements/1.1/"><dc:title>{t}</dc:title></cp:coreProperties>"#)
        });
        let types = r#"<?xml version="1.0"?><Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types"><Override PartName="/word/document.xml" ContentType="application/vnd.openxmlformats-officedocument.wordprocessingml.document.main+xml"/></Types>"#;
        let mut members: Vec<(&str, &[u8])> = vec![("[Content_Types].xml", types.as_bytes()), ("word/document.xml", document.as_bytes())];
        if let Some(core) = &core {
            members.push(("docProps/core.xml", core.as_bytes()));
        }
        zip(&members)
    }

    /// A Word paragraph of one run; `style` as `w:pStyle` (`Heading1`, `Title`, …).
    pub fn docx_paragraph(text: &str, style: Option<&str>) -> String {
        let props = style.map_or(String::new(), |s| format!(r#"<w:pPr><w:pStyle w:val="{s}"/></w:pPr>"#));
        format!(r#"<w:p>{props}<w:r><w:t xml:space="preserve">{text}</w:t></w:r></w:p>"#)
    }

    /// An `.odt` whose `office:text` holds `body`, with that title in `meta.xml` when given.
    pub fn odt(body: &str, title: Option<&str>) -> Vec<u8> {
        let ns = r#"xmlns:office="urn:oasis:names:tc:opendocument:xmlns:office:1.0" xmlns:text="urn:oasis:names:tc:opendocument:xmlns:text:1.0" xmlns:table="urn:oasis:names:tc:opendocument:xmlns:table:1.0" xmlns:dc="http://purl.org/dc/elements/1.1/""#;
        let content = format!(r#"<?xml version="1.0" encoding="UTF-8"?><office:document-content {ns}><office:body><office:text>{body}</office:text></office:body></office:document-content>"#);
        let meta = title.map(|t| format!(r#"<?xml version="1.0"?><office:document-meta {ns}><office:meta><dc:title>{t}</dc:title></office:meta></office:document-meta>"#));
        let manifest = r#"<?xml version="1.0"?><manifest:manifest xmlns:manifest="urn:oasis:names:tc:opendocument:xmlns:manifest:1.0"><manifest:file-entry manifest:full-path="/" manifest:media-type="application/vnd.oasis.opendocument.text"/></manifest:manifest>"#;
        let mut members: Vec<(&str, &[u8])> = vec![
            ("mimetype", b"application/vnd.oasis.opendocument.text"),
            ("content.xml", content.as_bytes()),
            ("META-INF/manifest.xml", manifest.as_bytes()),
        ];
        if let Some(meta) = &meta {
            members.push(("meta.xml", meta.as_bytes()));
        }
        zip(&members)
    }

    /// An EPUB 3 of these chapters (`(file name, body HTML)`, in reading order) under `OEBPS/`,
    /// plus a navigation document left out of the reading order (`linear="no"`).
    pub fn epub(title: &str, chapters: &[(&str, &str)]) -> Vec<u8> {
        let container = r#"<?xml version="1.0"?><container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container"><rootfiles><rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/></rootfiles></container>"#;
        let mut items = String::from(r#"<item id="nav" href="nav.xhtml" media-type="application/xhtml+xml" properties="nav"/>"#);
        let mut spine = String::from(r#"<itemref idref="nav" linear="no"/>"#);
        let mut files = vec![("OEBPS/nav.xhtml".to_string(), xhtml("Contents", "<nav><ol><li>Contents entry</li></ol></nav>"))];
        // Listed in the manifest in reverse: the spine, not the manifest, is the reading order.
        for (i, (name, body)) in chapters.iter().enumerate().rev() {
            items.push_str(&format!(r#"<item id="c{i}" href="{}" media-type="application/xhtml+xml"/>"#, name.replace(' ', "%20")));
            files.push((format!("OEBPS/{name}"), xhtml(name, body)));
        }
        for i in 0..chapters.len() {
            spine.push_str(&format!(r#"<itemref idref="c{i}"/>"#));
        }
        let opf = format!(
            r#"<?xml version="1.0"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0" unique-identifier="id"><metadata xmlns:dc="http://purl.org/dc/elements/1.1/"><dc:identifier id="id">test</dc:identifier><dc:title>{title}</dc:title><dc:language>en</dc:language></metadata><manifest>{items}</manifest><spine>{spine}</spine></package>"#
        );
        let mut members: Vec<(&str, &[u8])> =
            vec![("mimetype", b"application/epub+zip"), ("META-INF/container.xml", container.as_bytes()), ("OEBPS/content.opf", opf.as_bytes())];
        members.extend(files.iter().map(|(n, d)| (n.as_str(), d.as_bytes())));
        zip(&members)
    }

    fn xhtml(title: &str, body: &str) -> String {
        format!(r#"<?xml version="1.0" encoding="UTF-8"?><!DOCTYPE html><html xmlns="http://www.w3.org/1999/xhtml"><head><title>{title}</title></head><body>{body}</body></html>"#)
    }
}

/// Hostile uploads (issue 44): files made to hurt an extractor. `scripts/fuzz_corpus.py` writes
/// the same shapes as seeds of the fuzz corpus.
pub mod hostile {
    use std::io::Write;

    /// `<div>` opened `depth` times, never closed.
    pub fn nested_html(depth: usize) -> Vec<u8> {
        b"<div>".repeat(depth)
    }

    /// A Markdown list nested `depth` deep on one line (`- - - … x`).
    pub fn deep_markdown_list(depth: usize) -> Vec<u8> {
        let mut md = b"- ".repeat(depth);
        md.extend_from_slice(b"x\n");
        md
    }

    /// A one-page PDF whose FlateDecode page content inflates to `inflated` bytes: `unit`
    /// repeated (`b"\0"` for a bomb of zeros, `b"BT /F1 12 Tf (A) Tj ET\n"` for one of text
    /// operators).
    pub fn flate_bomb_pdf(unit: &[u8], inflated: usize) -> Vec<u8> {
        pdf(b"<< /Type /Catalog /Pages 2 0 R >>".to_vec(), Some(&zlib_of_repeated(unit, inflated)))
    }

    /// A PDF whose catalog holds an array nested `depth` deep.
    pub fn nested_array_pdf(depth: usize) -> Vec<u8> {
        let mut catalog = b"<< /Type /Catalog /Pages 2 0 R /Nest ".to_vec();
        catalog.extend(b"[".repeat(depth));
        catalog.extend(b"]".repeat(depth));
        catalog.extend_from_slice(b" >>");
        pdf(catalog, None)
    }

    /// Found by the fuzzer (extract_pdf): a page that is its own `Parent`.
    pub fn self_parent_pdf() -> Vec<u8> {
        let mut objects = standard_objects(b"<< /Type /Catalog /Pages 2 0 R >>".to_vec(), None);
        objects[2] = b"<< /Type /Page /Parent 3 0 R /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> >> >>".to_vec();
        write_objects(&objects)
    }

    /// A page that draws form XObject 1 of `forms`; form `k` shows a word and draws form
    /// `next(k)` (an object number among 6.., or none) `draws` times. `next(k) = k` is a form
    /// that draws itself; a chain whose forms each draw the next twice is work doubling at every
    /// level.
    pub fn form_pdf(forms: usize, draws: usize, next: impl Fn(usize) -> Option<usize>) -> Vec<u8> {
        let mut objects = standard_objects(b"<< /Type /Catalog /Pages 2 0 R >>".to_vec(), None);
        objects[2] = b"<< /Type /Page /Parent 2 0 R /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> /XObject << /X 6 0 R >> >> >>".to_vec();
        objects[3] = stream_object_with("", b"BT /F1 12 Tf 72 720 Td (plain words) Tj ET /X Do");
        for k in 0..forms {
            let (draw, xobjects) = match next(k) {
                Some(n) => ("/X Do ".repeat(draws), format!("/XObject << /X {} 0 R >>", 6 + n)),
                None => (String::new(), String::new()),
            };
            let content = format!("BT /F1 12 Tf 72 700 Td (form words) Tj ET {draw}");
            let form = format!("/Type /XObject /Subtype /Form /BBox [0 0 612 792] /Resources << /Font << /F1 5 0 R >> {xobjects} >>");
            objects.push(stream_object_with(&form, content.as_bytes()));
        }
        write_objects(&objects)
    }

    /// A page that draws (`Do`) an image whose FlateDecode data inflates to `inflated` zeros.
    pub fn image_bomb_pdf(inflated: usize) -> Vec<u8> {
        let mut objects = standard_objects(b"<< /Type /Catalog /Pages 2 0 R >>".to_vec(), None);
        objects[2] = b"<< /Type /Page /Parent 2 0 R /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> /XObject << /Im 6 0 R >> >> >>".to_vec();
        objects[3] = stream_object_with("", b"BT /F1 12 Tf 72 720 Td (plain words) Tj ET q 612 0 0 792 0 0 cm /Im Do Q");
        let image = format!("/Type /XObject /Subtype /Image /Width 1024 /Height {} /ColorSpace /DeviceGray /BitsPerComponent 8 /Filter /FlateDecode", inflated / 1024);
        objects.push(stream_object_with(&image, &zlib_of_repeated(b"\0", inflated)));
        write_objects(&objects)
    }

    /// A one-page PDF whose content stream is `unit` repeated to `len` bytes, encoded with
    /// `filters` (`FlateDecode`, `LZWDecode`, `ASCII85Decode`, listed in decoding order).
    pub fn encoded_pdf(filters: &[&str], unit: &[u8], len: usize) -> Vec<u8> {
        let mut data: Vec<u8> = unit.iter().copied().cycle().take(len).collect();
        for filter in filters.iter().rev() {
            data = match *filter {
                "FlateDecode" => {
                    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
                    let _ = z.write_all(&data);
                    z.finish().unwrap_or_default()
                }
                "LZWDecode" => weezl::encode::Encoder::with_tiff_size_switch(weezl::BitOrder::Msb, 8).encode(&data).unwrap_or_default(),
                "ASCII85Decode" => ascii85(&data),
                other => panic!("no encoder for {other}"),
            };
        }
        let names: String = filters.iter().map(|f| format!("/{f} ")).collect();
        let mut objects = standard_objects(b"<< /Type /Catalog /Pages 2 0 R >>".to_vec(), None);
        objects[3] = stream_object_with(&format!("/Filter [ {names}]"), &data);
        write_objects(&objects)
    }

    /// ASCII85 with `z` for four zero bytes and the `~>` end marker.
    fn ascii85(data: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(data.len() * 5 / 4 + 8);
        for chunk in data.chunks(4) {
            let mut group = [0u8; 4];
            group[..chunk.len()].copy_from_slice(chunk);
            let mut n = u32::from_be_bytes(group);
            if n == 0 && chunk.len() == 4 {
                out.push(b'z');
                continue;
            }
            let mut digits = [0u8; 5];
            for d in digits.iter_mut().rev() {
                *d = b'!' + (n % 85) as u8;
                n /= 85;
            }
            out.extend_from_slice(&digits[..chunk.len() + 1]);
        }
        out.extend_from_slice(b"~>");
        out
    }

    /// A one-page PDF with an object stream (`/Type /ObjStm`, read while the file is parsed)
    /// whose FlateDecode data inflates to `inflated` bytes of spaces; `disguised`: with strings
    /// that look like syntax to a byte scan (`(stream)` in the catalog, `(obj)` between the
    /// stream's `/Type` and its data).
    pub fn object_stream_bomb_pdf(inflated: usize, disguised: bool) -> Vec<u8> {
        let note = if disguised { "/Note (obj) " } else { "" };
        let o = stream_object_with(&format!("/Type /ObjStm {note}/N 1 /First 4 /Filter /FlateDecode"), &zlib_of_repeated(b" ", inflated));
        let catalog: &[u8] = if disguised { b"<< /Type /Catalog /Pages 2 0 R /Note (stream) >>" } else { b"<< /Type /Catalog /Pages 2 0 R >>" };
        let mut objects = standard_objects(catalog.to_vec(), None);
        objects.push(o);
        write_objects(&objects)
    }

    /// Objects 1 (the catalog given), 2 (pages), 3 (page), 4 (content: `stream` compressed,
    /// or a line of text), 5 (font), with a correct cross-reference table.
    fn pdf(catalog: Vec<u8>, stream: Option<&[u8]>) -> Vec<u8> {
        write_objects(&standard_objects(catalog, stream))
    }

    fn standard_objects(catalog: Vec<u8>, stream: Option<&[u8]>) -> Vec<Vec<u8>> {
        let mut objects: Vec<Vec<u8>> = vec![catalog];
        objects.push(b"<< /Type /Pages /Kids [3 0 R] /Count 1 /MediaBox [0 0 612 792] >>".to_vec());
        objects.push(b"<< /Type /Page /Parent 2 0 R /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> >> >>".to_vec());
        objects.push(match stream {
            Some(s) => stream_object_with("/Filter /FlateDecode", s),
            None => stream_object_with("", b"BT /F1 12 Tf 72 720 Td (plain words) Tj ET"),
        });
        objects.push(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>".to_vec());
        objects
    }

    /// A stream object holding `data` as it is, its dictionary `entries` and its `/Length`.
    fn stream_object_with(entries: &str, data: &[u8]) -> Vec<u8> {
        let mut o = format!("<< {entries} /Length {} >>\nstream\n", data.len()).into_bytes();
        o.extend_from_slice(data);
        o.extend_from_slice(b"\nendstream");
        o
    }

    /// `unit` repeated to `len` bytes, zlib-compressed (default level) a MiB at a time.
    fn zlib_of_repeated(unit: &[u8], len: usize) -> Vec<u8> {
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        let chunk = unit.repeat((1 << 20) / unit.len().max(1) + 1);
        let mut left = len;
        while left > 0 {
            let n = left.min(chunk.len());
            let _ = z.write_all(&chunk[..n]);
            left -= n;
        }
        z.finish().unwrap_or_default()
    }

    /// Objects numbered from 1 in order, a correct cross-reference table, catalog 1.
    fn write_objects(objects: &[Vec<u8>]) -> Vec<u8> {
        let mut out = b"%PDF-1.5\n".to_vec();
        let mut offsets = Vec::new();
        for (i, body) in objects.iter().enumerate() {
            offsets.push(out.len());
            out.extend(format!("{} 0 obj\n", i + 1).into_bytes());
            out.extend_from_slice(body);
            out.extend_from_slice(b"\nendobj\n");
        }
        let xref = out.len();
        out.extend(format!("xref\n0 {}\n0000000000 65535 f \n", objects.len() + 1).into_bytes());
        for o in offsets {
            out.extend(format!("{o:010} 00000 n \n").into_bytes());
        }
        out.extend(format!("trailer\n<< /Size {} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n", objects.len() + 1).into_bytes());
        out
    }
}

/// The largest absolute difference between two adapters' tensors (the same names in the same
/// order).
pub fn max_adapter_diff(a: &crate::adapters::AdapterBundle, b: &crate::adapters::AdapterBundle) -> f32 {
    let (ta, tb) = (a.named_tensors(), b.named_tensors());
    assert_eq!(ta.len(), tb.len());
    ta.iter()
        .zip(&tb)
        .map(|((na, x), (nb, y))| {
            assert_eq!(na, nb);
            (x - y).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
        })
        .fold(0.0, f32::max)
}
