//! Adapter kinds (Gated Memory, LoRA) and their storage, on a tiny random model written to disk:
//! a fresh LoRA is exactly the base model, gradients reach adapter factors only, save → load is
//! bit-identical, and bad or foreign files are refused with errors that name them.

use candle_core::{DType, Device, Tensor};
use lift_serve::adapters::manifest::{ADAPTER_FILE, MANIFEST_FILE};
use lift_serve::adapters::{
    load, save, AdapterBundle, AdapterKind, AnyAdapter, BaseModelRef, DocumentRef, GatedMemory, Lora, LoraConfig,
    Manifest,
};
use lift_serve::model::{ops, Adapter, KvCache, Logits, Model, NoHooks, Projection};
use lift_serve::testing::{write_hf, Rng, TinySpec};
use serde_json::json;
use std::path::Path;

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

fn tiny_named(root: &Path, name: &str, spec: &TinySpec) -> Model {
    let path = write_hf(&root.join(name), spec).unwrap();
    Model::load(&path, &Device::Cpu).unwrap()
}

/// A tiny model with an f32 KV cache and f32 float matmuls, so the inference path agrees with
/// the trainable one to float precision (the default f16 cache rounds keys and values, the
/// default bf16 matmuls their inputs).
fn tiny() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let mut model = tiny_named(dir.path(), "tiny", &TinySpec::default());
    model.decoder.cpu_kv_dtype = candle_core::DType::F32;
    model.decoder.cpu_float_dtype = candle_core::DType::F32;
    (dir, model)
}

fn input(model: &Model, text: &str) -> Tensor {
    let toks = model.tokenizer.encode(text, false).unwrap();
    Tensor::new(toks.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap()
}

fn infer(model: &Model, ids: &Tensor, adapter: Option<&dyn Adapter>) -> Tensor {
    let mut cache = KvCache::new(model.config().num_layers);
    model.decoder.forward(ids, &mut cache, adapter, &mut NoHooks, Logits::All).unwrap()
}

fn small_lora(targets: Vec<Projection>, layers: Vec<usize>) -> LoraConfig {
    LoraConfig { rank: 4, alpha: 8.0, targets, layers }
}

/// A LoRA whose B factors are random (as after some training), detached.
fn trained_lora(model: &Model, cfg: &LoraConfig, seed: u64) -> AnyAdapter {
    let fresh = AnyAdapter::Lora(Lora::new(model.config(), cfg, seed, &Device::Cpu).unwrap());
    let mut rng = Rng::new(seed + 1000);
    let tensors: Vec<(String, Tensor)> = fresh
        .named_tensors()
        .into_iter()
        .map(|(n, t)| {
            if n.ends_with("lora_b") {
                let r = Tensor::from_vec(rng.vec(t.elem_count(), 0.2), t.dims(), &Device::Cpu).unwrap();
                (n, r)
            } else {
                (n, t)
            }
        })
        .collect();
    let cfg = fresh.lora_config().unwrap().clone();
    AnyAdapter::from_named_tensors(AdapterKind::Lora, model.config(), Some(&cfg), tensors).unwrap()
}

fn manifest_for(model: &Model, bundle: &AdapterBundle, training: serde_json::Value) -> Manifest {
    Manifest::new(
        bundle,
        BaseModelRef::of(model),
        DocumentRef::new("A long document about adapters.", 31, Some("adapters".into())),
        json!({"epochs": 3, "lr": 1e-3}),
        training,
    )
}

fn err_text<T>(r: anyhow::Result<T>) -> String {
    format!("{:#}", r.err().expect("expected an error"))
}

#[test]
fn fresh_lora_is_exactly_the_base_model_and_a_nonzero_b_changes_it() {
    let (_dir, model) = tiny();
    let ids = input(&model, "A fresh LoRA must not change a single logit.");
    let base = infer(&model, &ids, None);
    let cfg = small_lora(Projection::ALL.to_vec(), vec![]);
    let fresh = Lora::new(model.config(), &cfg, 1, &Device::Cpu).unwrap();
    assert_eq!(fresh.vars().len(), 2 * 7 * 2);
    assert_eq!(fresh.num_parameters(), cfg.num_parameters(model.config()));
    let det = fresh.detached();
    assert!(det.vars().is_empty());
    assert_eq!(max_abs_diff(&base, &infer(&model, &ids, Some(&det))), 0.0, "B = 0: logits must be identical");

    let trained = trained_lora(&model, &cfg, 1);
    let adapted = infer(&model, &ids, Some(&trained));
    assert!(max_abs_diff(&base, &adapted) > 1e-3, "a LoRA with nonzero B must change the logits");

    // The trainable path agrees with the inference path.
    let emb = model.decoder.embed(&ids).unwrap();
    let trainable = trained.trainable(model.config()).unwrap();
    let hidden = model.decoder.forward_train(&emb, Some(&trainable), &mut NoHooks).unwrap();
    let train = model.decoder.logits_train(&hidden).unwrap();
    assert!(max_abs_diff(&adapted, &train) <= 1e-4);

    // A single target on layer 1 only: the adapter starts at layer 1 and still changes the output.
    let one = trained_lora(&model, &small_lora(vec![Projection::V], vec![1]), 2);
    assert_eq!(one.first_layer(), 1);
    assert_eq!(one.layers(), vec![1]);
    assert_eq!(one.num_parameters(), 4 * (64 + 32));
    assert!(max_abs_diff(&base, &infer(&model, &ids, Some(&one))) > 1e-4);
}

fn frozen_weights(model: &Model) -> Vec<&Tensor> {
    let d = &model.decoder;
    let mut frozen: Vec<&Tensor> = vec![&d.embed, &d.norm, d.lm_head.float_weight().unwrap()];
    for l in &d.layers {
        frozen.push(&l.attn_norm);
        frozen.push(&l.ffn_norm);
        for lin in [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down] {
            frozen.push(lin.float_weight().unwrap());
        }
    }
    frozen
}

fn grad_norm2(g: &Tensor) -> f32 {
    g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap()
}

#[test]
fn lora_gradients_reach_a_and_b_only() {
    let (_dir, model) = tiny();
    let toks = model.tokenizer.encode("Gradients flow into the low-rank factors only.", false).unwrap();
    let ids = Tensor::new(&toks[..toks.len() - 1], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let target = Tensor::new(&toks[1..], &Device::Cpu).unwrap();
    let w = Tensor::ones(target.dims1().unwrap(), DType::F32, &Device::Cpu).unwrap();
    let backward = |adapter: &AnyAdapter| {
        let emb = model.decoder.embed(&ids).unwrap();
        let hidden = model.decoder.forward_train(&emb, Some(adapter), &mut NoHooks).unwrap();
        let logits = model.decoder.logits_train(&hidden.squeeze(0).unwrap()).unwrap();
        let loss = ops::cross_entropy_masked(&logits, &target, &w).unwrap();
        let grads = loss.backward().unwrap();
        for t in frozen_weights(&model) {
            assert!(grads.get(t).is_none(), "a frozen weight received a gradient");
        }
        // candle's backward also stores the gradient of a plain tensor that is a direct input of a
        // tracked op (layer 0's residual add when layer 0 is adapted) without propagating it
        // further; with layer 0 frozen, the embeddings see no tracked op at all.
        if adapter.first_layer() > 0 {
            assert!(grads.get(&emb).is_none(), "input embeddings are not trainable here");
        }
        grads
    };

    // Trained (nonzero B) on all layers, and on layer 1 only (layer 0 then runs without a graph).
    for layers in [vec![], vec![1]] {
        let cfg = small_lora(Projection::ALL.to_vec(), layers.clone());
        let adapter = trained_lora(&model, &cfg, 3).trainable(model.config()).unwrap();
        assert_eq!(adapter.vars().len(), adapter.named_tensors().len());
        let grads = backward(&adapter);
        for (v, (name, _)) in adapter.vars().iter().zip(adapter.named_tensors()) {
            let g = grads.get(v.as_tensor()).unwrap_or_else(|| panic!("layers {layers:?}: no gradient for {name}"));
            let n = grad_norm2(g);
            assert!(n > 0.0 && n.is_finite(), "{name}: gradient norm² {n}");
        }
    }

    // Fresh (B = 0): B gets a gradient, A's is exactly zero (standard LoRA start).
    let fresh = AnyAdapter::Lora(Lora::new(model.config(), &small_lora(Projection::ALL.to_vec(), vec![]), 4, &Device::Cpu).unwrap());
    let grads = backward(&fresh);
    for (v, (name, _)) in fresh.vars().iter().zip(fresh.named_tensors()) {
        let n = grad_norm2(grads.get(v.as_tensor()).expect("every factor has a gradient"));
        if name.ends_with("lora_b") {
            assert!(n > 0.0, "{name}: B must get a gradient from the start");
        } else {
            assert_eq!(n, 0.0, "{name}: A's gradient is zero while B = 0");
        }
    }
}

#[test]
fn an_adapter_with_a_per_document_filter_is_refused_at_load() {
    // Earlier versions trained a FltLM filter per document; it now belongs to the prepared base.
    let (dir, model) = tiny();
    let gm = AnyAdapter::GatedMemory(GatedMemory::new(model.config(), &[1], false, 7, &Device::Cpu).unwrap());
    let mut bundle = AdapterBundle::new(gm);
    let hidden = model.config().hidden_size;
    bundle.extras.insert("filter.head.weight".into(), Tensor::zeros(hidden, DType::F32, &Device::Cpu).unwrap());
    let manifest = manifest_for(&model, &bundle, json!({"steps": 5}));
    let path = dir.path().join("adapters").join("old");
    save(&path, &bundle, &manifest, &[]).unwrap();
    let err = load(&path, &model).err().expect("refused");
    assert!(format!("{err:#}").contains("absorb the document again"), "{err:#}");
}

#[test]
fn save_then_load_is_bit_identical_for_both_kinds_with_extras() {
    let (dir, model) = tiny();
    let ids = input(&model, "Stored adapters must come back exactly.");
    let gm = AnyAdapter::GatedMemory(GatedMemory::new(model.config(), &[1], false, 7, &Device::Cpu).unwrap());
    let lora = trained_lora(&model, &small_lora(vec![Projection::Q, Projection::V, Projection::Down], vec![0, 1]), 8);
    let hidden = model.config().hidden_size;
    let head = Tensor::from_vec(Rng::new(9).vec(hidden, 0.3), (1, hidden), &Device::Cpu).unwrap();
    let bias = Tensor::new(&[0.25f32], &Device::Cpu).unwrap();
    let half = Tensor::new(&[1.5f32, -2.0], &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();

    for (i, adapter) in [gm, lora].into_iter().enumerate() {
        let mut bundle = AdapterBundle::new(adapter.clone());
        if adapter.kind() == AdapterKind::Lora {
            bundle.extras.insert("probe.head.weight".into(), head.clone());
            bundle.extras.insert("probe.head.bias".into(), bias.clone());
            bundle.extras.insert("probe.scale_bf16".into(), half.clone());
        }
        let manifest = manifest_for(&model, &bundle, json!({"steps": 5, "final_loss": 1.25}));
        let path = dir.path().join("adapters").join(format!("doc{i}"));
        save(&path, &bundle, &manifest, &[]).unwrap();
        let mut files: Vec<String> =
            std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect();
        files.sort();
        assert_eq!(files, vec![ADAPTER_FILE, MANIFEST_FILE]);

        let listed = Manifest::read(&path).unwrap();
        let (loaded, m) = load(&path, &model).unwrap();
        assert_eq!(listed, m);
        assert_eq!(m.adapter_sha256.len(), 64);
        let mut m2 = m.clone();
        m2.adapter_sha256.clear();
        assert_eq!(m2, manifest, "the manifest round-trips");
        assert_eq!(m.kind, adapter.kind());
        assert_eq!(m.parameters, bundle.num_parameters());
        assert_eq!(m.bytes, bundle.bytes());
        assert_eq!(m.layers, adapter.layers());
        assert_eq!(m.base_model.id, "tiny");
        assert_eq!(m.base_model.fingerprint, model.info.fingerprint);

        // Loaded for inference: detached, same tensors bit for bit, same logits bit for bit.
        assert!(loaded.adapter.vars().is_empty());
        assert_eq!(loaded.adapter.kind(), adapter.kind());
        let (a, b) = (adapter.named_tensors(), loaded.adapter.named_tensors());
        assert_eq!(a.iter().map(|x| &x.0).collect::<Vec<_>>(), b.iter().map(|x| &x.0).collect::<Vec<_>>());
        for ((n, x), (_, y)) in a.iter().zip(&b) {
            assert_eq!(max_abs_diff(x, y), 0.0, "{n} changed");
        }
        let before = infer(&model, &ids, Some(&adapter.detached()));
        let after = infer(&model, &ids, Some(&loaded.adapter));
        assert_eq!(max_abs_diff(&before, &after), 0.0, "{}: logits differ after a round trip", adapter.kind());

        // Extras come back with their names, shapes, dtypes and values.
        assert_eq!(loaded.extras.len(), bundle.extras.len());
        for (n, t) in &bundle.extras {
            let l = &loaded.extras[n];
            assert_eq!((l.dims(), l.dtype()), (t.dims(), t.dtype()), "{n}");
            let d = max_abs_diff(&l.to_dtype(DType::F32).unwrap(), &t.to_dtype(DType::F32).unwrap());
            assert_eq!(d, 0.0, "{n}");
        }

        // Resuming training: Vars again, with the same values.
        let resumed = loaded.adapter.trainable(model.config()).unwrap();
        assert_eq!(resumed.vars().len(), adapter.named_tensors().len());
        assert_eq!(max_abs_diff(&resumed.vars()[0].as_tensor().clone(), &a[0].1), 0.0);
    }
    // No staging leftovers beside the adapters.
    let mut names: Vec<String> = std::fs::read_dir(dir.path().join("adapters"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    names.sort();
    assert_eq!(names, vec!["doc0", "doc1"]);
}

#[test]
fn an_adapter_for_another_base_model_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = tiny_named(dir.path(), "tiny-a", &TinySpec::default());
    let b = tiny_named(dir.path(), "tiny-b", &TinySpec { seed: 43, ..Default::default() });
    assert_ne!(a.info.fingerprint, b.info.fingerprint);
    let bundle = AdapterBundle::new(GatedMemory::new(a.config(), &[0, 1], false, 1, &Device::Cpu).unwrap());
    let path = dir.path().join("adapter");
    save(&path, &bundle, &manifest_for(&a, &bundle, json!({})), &[]).unwrap();
    assert!(load(&path, &a).is_ok());
    let err = err_text(load(&path, &b));
    for needle in ["tiny-a", "tiny-b", &a.info.fingerprint, &b.info.fingerprint] {
        assert!(err.contains(needle), "error should mention {needle}: {err}");
    }
}

#[test]
fn damaged_or_missing_files_give_errors_naming_the_file() {
    let (dir, model) = tiny();
    let bundle = AdapterBundle::new(trained_lora(&model, &small_lora(vec![Projection::O], vec![]), 5));
    let manifest = manifest_for(&model, &bundle, json!({}));
    let path = dir.path().join("a");
    let fresh = |p: &Path| {
        save(p, &bundle, &manifest, &[]).unwrap();
        (p.join(ADAPTER_FILE), p.join(MANIFEST_FILE))
    };

    // Truncated tensor file.
    let (st, _) = fresh(&path);
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let err = err_text(load(&path, &model));
    assert!(err.contains(ADAPTER_FILE) && err.contains("truncated"), "{err}");

    // One flipped byte in the tensor data: the checksum catches it.
    let (st, _) = fresh(&path);
    let mut bytes = std::fs::read(&st).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 0x40;
    std::fs::write(&st, &bytes).unwrap();
    let err = err_text(load(&path, &model));
    assert!(err.contains(ADAPTER_FILE) && err.contains("does not match"), "{err}");

    // Missing tensor file, missing manifest, truncated manifest.
    let (st, mf) = fresh(&path);
    std::fs::remove_file(&st).unwrap();
    let err = err_text(load(&path, &model));
    assert!(err.contains(ADAPTER_FILE), "{err}");
    std::fs::remove_file(&mf).unwrap();
    let err = err_text(load(&path, &model));
    assert!(err.contains(MANIFEST_FILE), "{err}");
    let (_, mf) = fresh(&path);
    let text = std::fs::read(&mf).unwrap();
    std::fs::write(&mf, &text[..text.len() / 2]).unwrap();
    let err = err_text(load(&path, &model));
    assert!(err.contains(MANIFEST_FILE) && err.contains("not valid JSON"), "{err}");

    // The manifest disagrees with the file about a shape.
    let (_, mf) = fresh(&path);
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&mf).unwrap()).unwrap();
    v["shapes"]["layers.1.o_proj.lora_a"] = json!([64, 5]);
    std::fs::write(&mf, serde_json::to_vec(&v).unwrap()).unwrap();
    let err = err_text(load(&path, &model));
    assert!(err.contains(ADAPTER_FILE) && err.contains("layers.1.o_proj.lora_a"), "{err}");

    // A missing directory.
    let err = err_text(load(&dir.path().join("nope"), &model));
    assert!(err.contains("nope") && err.contains(MANIFEST_FILE), "{err}");
}

#[test]
fn an_unknown_format_version_is_refused() {
    let (dir, model) = tiny();
    let bundle = AdapterBundle::new(GatedMemory::new(model.config(), &[1], false, 2, &Device::Cpu).unwrap());
    let path = dir.path().join("a");
    save(&path, &bundle, &manifest_for(&model, &bundle, json!({})), &[]).unwrap();
    let mf = path.join(MANIFEST_FILE);
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&mf).unwrap()).unwrap();
    v["format_version"] = json!(99);
    v["some_future_field"] = json!({"x": 1});
    std::fs::write(&mf, serde_json::to_vec(&v).unwrap()).unwrap();
    for err in [err_text(Manifest::read(&path)), err_text(load(&path, &model))] {
        assert!(err.contains(MANIFEST_FILE) && err.contains("format_version 99"), "{err}");
    }
}

#[test]
fn replacing_an_adapter_never_shows_a_torn_pair() {
    let (dir, model) = tiny();
    let path = dir.path().join("store").join("doc");
    // Two different adapters; the extra `tag` tensor and the manifest's training figures both say
    // which one it is, so a reader can tell a torn pair.
    let bundles: Vec<(AdapterBundle, Manifest)> = (0..2)
        .map(|i| {
            let mut b = AdapterBundle::new(trained_lora(&model, &small_lora(vec![Projection::Up], vec![]), 20 + i));
            b.extras.insert("tag".into(), Tensor::new(&[i as f32], &Device::Cpu).unwrap());
            let m = manifest_for(&model, &b, json!({"tag": i}));
            (b, m)
        })
        .collect();
    save(&path, &bundles[0].0, &bundles[0].1, &[]).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let reads = std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) || n == 0 {
                let (b, m) = load(&path, &model).expect("a concurrent reader always finds a complete adapter");
                let tag = b.extras["tag"].to_vec1::<f32>().unwrap()[0];
                assert_eq!(tag as u64, m.training["tag"].as_u64().unwrap(), "torn pair");
                n += 1;
            }
            n
        });
        for k in 0..40 {
            let (b, m) = &bundles[(k + 1) % 2];
            save(&path, b, m, &[]).unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        reader.join().unwrap()
    });
    assert!(reads > 0);
    let (b, _) = load(&path, &model).unwrap();
    assert_eq!(b.extras["tag"].to_vec1::<f32>().unwrap()[0], 0.0, "the last save wins");
    let names: Vec<String> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert_eq!(names, vec!["doc"], "no staging leftovers");

    // A directory that holds anything else is never replaced.
    let other = dir.path().join("not-an-adapter");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("notes.txt"), "keep me").unwrap();
    let err = err_text(save(&other, &bundles[0].0, &bundles[0].1, &[]));
    assert!(err.contains("notes.txt") && err.contains("refusing"), "{err}");
    assert_eq!(std::fs::read_to_string(other.join("notes.txt")).unwrap(), "keep me");

    // A manifest that does not describe the bundle is refused before anything is written.
    let mut wrong = bundles[0].1.clone();
    wrong.kind = AdapterKind::GatedMemory;
    let err = err_text(save(&dir.path().join("x"), &bundles[0].0, &wrong, &[]));
    assert!(err.contains("manifest"), "{err}");
    assert!(!dir.path().join("x").exists());

    // Extras may not use the adapter's namespace.
    let mut bad = bundles[0].0.clone();
    bad.extras.insert("layers.0.extra".into(), Tensor::new(&[1f32], &Device::Cpu).unwrap());
    let m = manifest_for(&model, &bad, json!({}));
    assert!(err_text(save(&dir.path().join("y"), &bad, &m, &[])).contains("reserved"));
}

#[test]
fn gated_memory_with_biases_round_trips_on_a_qwen2_style_model() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_named(dir.path(), "tiny-qwen", &TinySpec { qkv_bias: true, ..Default::default() });
    assert!(model.config().attention_bias);
    let gm = GatedMemory::new(model.config(), &[0], true, 11, &Device::Cpu).unwrap();
    assert_eq!(gm.vars().len(), 7);
    let bundle = AdapterBundle::new(gm.clone());
    let path = dir.path().join("gm");
    save(&path, &bundle, &manifest_for(&model, &bundle, json!({})), &[]).unwrap();
    let (loaded, m) = load(&path, &model).unwrap();
    assert_eq!(m.shapes.len(), 7);
    assert!(m.shapes.contains_key("layers.0.mem_b1") && m.lora.is_none());
    let ids = input(&model, "biases too");
    let det = gm.detached();
    assert_eq!(max_abs_diff(&infer(&model, &ids, Some(&det)), &infer(&model, &ids, Some(&loaded.adapter))), 0.0);
}
