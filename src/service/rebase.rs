//! A new base under stored documents (an upgraded prepared base, another model). Every document
//! whose saved adapter was made over another base is absorbed again over the server's, with the
//! options it was absorbed with and under the id it was posted under:
//!
//! - **one at a time, behind what users post**: the next one is queued when the last has ended, so
//!   a new document waits for at most one of them;
//! - **the most recently asked first** (`JobRecord::last_asked_at`; never asked: posting order);
//! - **answering meanwhile**: from its passages and its training's snapshots (the engine reads
//!   the live document, not the old adapter), and its view says why (`reabsorbing`);
//! - **losing nothing**: the old adapter stays until the new one replaces it (served over its own
//!   base again before then, it answers as before), and a restart resumes from the kept text and
//!   the absorb's checkpoint (`Store::recover` finds the document again).

use super::records::Records;
use crate::engine::Engine;
use crate::store::JobRecord;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// The documents to absorb again, in the order they are queued: the most recently asked first,
/// then those never asked in posting order.
pub(super) fn order(mut docs: Vec<(JobRecord, String)>) -> Vec<(String, String)> {
    docs.sort_by(|(a, _), (b, _)| {
        b.last_asked_at.cmp(&a.last_asked_at).then_with(|| a.posting_order().cmp(&b.posting_order()))
    });
    docs.into_iter().map(|(rec, text)| (rec.id, text)).collect()
}

/// Queues `docs` one at a time on a thread of its own (it waits on their jobs); stops when the
/// server shuts down (those not queued yet are found again at the next start).
pub(super) fn feed(records: Arc<Records>, engine: Arc<Engine>, docs: Vec<(String, String)>) {
    if docs.is_empty() {
        return;
    }
    tracing::info!(documents = docs.len(), "adapters made over another base: absorbing them again, the most recently asked first");
    let stopping = {
        let records = records.clone();
        move || records.shutting_down.load(Ordering::SeqCst)
    };
    let spawned = std::thread::Builder::new().name("reabsorb".into()).spawn(move || {
        for (id, text) in docs {
            if stopping() {
                return;
            }
            records.requeue(&engine, &id, text);
            while !ended(&records, &id) && !stopping() {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        tracing::info!("every document over another base was absorbed again");
    });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start absorbing the documents over another base again");
    }
}

/// The document's job has ended (ready, failed, cancelled) or the document was deleted.
fn ended(records: &Records, id: &str) -> bool {
    records.docs.read().map_or(true, |d| d.get(id).is_none_or(|e| e.rec.status.is_terminal()))
}
