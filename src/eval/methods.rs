//! The methods `eval` compares: named presets of an answer mode and the absorb options of its
//! adapter, with an optional context policy and budget per method (`lift:head_tail:256`).

use crate::lift::answer::{ContextPolicy, Mode};
use crate::lift::AbsorbOptions;
use anyhow::{bail, Context, Result};
use serde::Serialize;

/// A method: an answer mode, and the absorb options of its adapter (`None`: no adapter).
#[derive(Clone, Debug, Serialize)]
pub struct Method {
    pub name: String,
    pub mode: Mode,
    /// The context policy it answers with (`None`: the mode's default).
    pub context: Option<ContextPolicy>,
    /// Its in-context budget in tokens (`None`: the run's `--context-tokens`).
    pub context_tokens: Option<usize>,
    /// `:each`: each passage of the budget read on its own, the likeliest answer kept
    /// ([`answer_each_passage`](crate::lift::answer::answer_each_passage)).
    pub each_passage: bool,
    pub absorb: Option<AbsorbOptions>,
}

/// The known methods and what they are. A new variant is one entry here and one arm in
/// [`method`]: the absorb options it changes and the mode it asks in. (FltLM and CDT are not
/// methods: they are the prepared base's, under every method; compare bases with
/// `--prepared-base`.)
pub const METHODS: &[(&str, &str)] = &[
    ("rag", "base model, the passages retrieved for the question in context, no adapter"),
    ("icl", "base model, truncated document in context (head + tail): the paper's baseline"),
    ("lift", "adapter absorbed from the document + the retrieved passages in context"),
    ("memory", "adapter only, no document text in context"),
    ("lift-paper", "lift absorbed with the paper's recipe (AbsorbOptions::paper_faithful)"),
    ("lift-fixed", "lift absorbed on the fixed schedule (the epochs run to their end)"),
    ("lift-until-learned", "lift absorbed until learned (train.until_learned; its defaults unless the options set it)"),
];

/// The method preset `name` on top of the base absorb options (for a model of `num_layers`).
/// `name:policy` answers with that context policy (`lift:head_tail`, `icl:full`, …) and
/// `name:N` with an in-context budget of N tokens (`rag:256`, `lift:head_tail:256`), so one
/// absorb answers at several budgets; `name:each` reads each passage of the budget on its own.
pub fn method(name: &str, base: &AbsorbOptions, num_layers: usize) -> Result<Method> {
    let mut parts = name.split(':');
    let preset = parts.next().unwrap_or_default();
    let (mut context, mut context_tokens, mut each_passage) = (None, None, false);
    for p in parts {
        if p == "each" {
            anyhow::ensure!(!each_passage, "method '{name}': `each` once");
            each_passage = true;
        } else if let Ok(n) = p.parse::<usize>() {
            anyhow::ensure!(n > 0 && context_tokens.is_none(), "method '{name}': one budget of at least 1 token");
            context_tokens = Some(n);
        } else {
            let policy = ContextPolicy::parse(p).with_context(|| {
                format!("unknown context policy '{p}' in method '{name}' (bm25, retrieved, linked, head_tail, full, or a budget in tokens)")
            })?;
            anyhow::ensure!(context.is_none(), "method '{name}': one context policy");
            context = Some(policy);
        }
    }
    let (mode, absorb) = match preset {
        "rag" => (Mode::Rag, None),
        "icl" => (Mode::Icl, None),
        "lift" => (Mode::Lift, Some(base.clone())),
        "memory" => (Mode::Memory, Some(base.clone())),
        "lift-paper" => {
            // The paper trains with the same truncated document it answers with: the context
            // budget stays the run's.
            let mut o = AbsorbOptions::paper_faithful(num_layers);
            o.plan.training_context_tokens = base.plan.training_context_tokens;
            (Mode::Lift, Some(o))
        }
        "lift-fixed" => {
            let mut o = base.clone();
            o.train.until_learned = None;
            (Mode::Lift, Some(o))
        }
        "lift-until-learned" => {
            let mut o = base.clone();
            o.train.until_learned.get_or_insert_with(Default::default);
            (Mode::Lift, Some(o))
        }
        _ => {
            let known: Vec<_> = METHODS.iter().map(|m| m.0).collect();
            bail!("unknown method '{name}' (known: {})", known.join(", "))
        }
    };
    anyhow::ensure!(
        mode.uses_context() || (context.is_none() && context_tokens.is_none()),
        "method '{name}': `memory` shows no context to choose"
    );
    anyhow::ensure!(
        context != Some(ContextPolicy::Full) || context_tokens.is_none(),
        "method '{name}': `full` shows what fits the window, not a budget"
    );
    anyhow::ensure!(
        !each_passage
            || (mode.uses_context() && context.unwrap_or(mode.default_context()).retrieves()),
        "method '{name}': `each` reads retrieved passages (rag or lift, bm25, retrieved or linked)"
    );
    Ok(Method { name: name.to_string(), mode, context, context_tokens, each_passage, absorb })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_presets_are_modes_and_absorb_options() {
        let base = AbsorbOptions::default();
        for (name, _) in METHODS {
            let m = method(name, &base, 30).unwrap();
            assert_eq!(m.absorb.is_none(), ["icl", "rag"].contains(name), "{name}");
        }
        let h = method("lift:head_tail", &base, 30).unwrap();
        assert_eq!((h.mode, h.context, h.absorb.is_some()), (Mode::Lift, Some(ContextPolicy::HeadTail), true));
        assert!(method("lift:everything", &base, 30).is_err() && method("memory:full", &base, 30).is_err());
        assert_eq!(method("memory", &base, 30).unwrap().mode, Mode::Memory);
        // A budget per method: one absorb answers at several budgets.
        let b = method("lift:head_tail:256", &base, 30).unwrap();
        assert_eq!((b.context, b.context_tokens), (Some(ContextPolicy::HeadTail), Some(256)));
        assert_eq!(method("rag:64", &base, 30).unwrap().context_tokens, Some(64));
        assert_eq!(method("lift", &base, 30).unwrap().context_tokens, None);
        assert!(method("rag:each:128", &base, 30).unwrap().each_passage && !method("rag", &base, 30).unwrap().each_passage);
        assert!(method("icl:each", &base, 30).is_err() && method("lift:head_tail:each", &base, 30).is_err());
        for bad in ["memory:64", "icl:full:64", "lift:0", "rag:64:128", "lift:full:head_tail"] {
            assert!(method(bad, &base, 30).is_err(), "{bad}");
        }
        // FltLM and CDT belong to the prepared base, not to a method.
        assert!(method("lift+filter", &base, 30).is_err() && method("lift+cdt", &base, 30).is_err());
        let p = method("lift-paper", &base, 30).unwrap().absorb.unwrap();
        assert_eq!((p.layers.unwrap().len(), p.train.epochs, p.plan.window), (30, [3, 5], 256));
        assert!(method("nope", &base, 30).is_err());
    }
}
