//! `run --trace FILE.json`: the ranks' timelines of chosen steps ([`autotp_runtime::trace`])
//! as Chrome's Trace Event Format (`{"traceEvents": [...]}`), which Perfetto (ui.perfetto.dev)
//! and chrome://tracing open: a process per rank (`rank R (stage S)`), a thread per stream
//! (`compute`, `collectives`, `peer`), a complete (`X`) event per span, in microseconds from
//! the earliest span (decimals carry the nanoseconds). In a job of processes every rank's spans travel to rank 0 as JSON
//! ([`spans_to_json`], [`spans_from_json`]).

use autotp_runtime::trace::Span;
use serde_json::{json, Value};

/// One rank's spans.
#[derive(Clone, Debug, PartialEq)]
pub struct RankTrace {
    pub rank: usize,
    pub stage: usize,
    pub spans: Vec<Span>,
}

/// The lanes in their display order.
const LANES: [&str; 4] = ["compute", "collectives", "peer", "transfer"];

fn tid(lane: &str) -> usize {
    LANES.iter().position(|l| *l == lane).unwrap_or(LANES.len())
}

/// The ranks' spans as a Chrome trace.
pub fn chrome_trace(ranks: &[RankTrace]) -> Value {
    let origin = ranks.iter().flat_map(|r| &r.spans).map(|s| s.start_ns).min().unwrap_or(0);
    let micros = |ns: u64| ns as f64 / 1e3;
    let mut events = Vec::new();
    for rank in ranks {
        let pid = rank.rank;
        let name = format!("rank {} (stage {})", rank.rank, rank.stage);
        events.push(json!({ "name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": { "name": name } }));
        events.push(
            json!({ "name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": { "sort_index": pid } }),
        );
        let mut lanes: Vec<&str> = rank.spans.iter().map(|s| s.lane.as_str()).collect();
        lanes.sort_by_key(|lane| tid(lane));
        lanes.dedup();
        for lane in lanes {
            events.push(
                json!({ "name": "thread_name", "ph": "M", "pid": pid, "tid": tid(lane), "args": { "name": lane } }),
            );
        }
        for span in &rank.spans {
            events.push(json!({
                "name": span.name, "cat": span.category, "ph": "X", "pid": pid, "tid": tid(&span.lane),
                "ts": micros(span.start_ns - origin), "dur": micros(span.duration_ns), "args": { "label": span.label },
            }));
        }
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

/// A rank's trace as JSON bytes, to send to rank 0.
pub fn spans_to_json(trace: &RankTrace) -> Vec<u8> {
    let spans: Vec<Value> =
        (trace.spans.iter()).map(|s| json!([s.lane, s.name, s.category, s.label, s.start_ns, s.duration_ns])).collect();
    json!({ "rank": trace.rank, "stage": trace.stage, "spans": spans }).to_string().into_bytes()
}

/// [`spans_to_json`]'s bytes back (trailing NUL padding ignored); `None` if they do not parse.
pub fn spans_from_json(bytes: &[u8]) -> Option<RankTrace> {
    let end = bytes.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    let value: Value = serde_json::from_slice(&bytes[..end]).ok()?;
    let text = |v: &Value| v.as_str().map(str::to_string);
    let spans = (value["spans"].as_array()?.iter())
        .map(|s| {
            Some(Span {
                lane: text(&s[0])?,
                name: text(&s[1])?,
                category: text(&s[2])?,
                label: text(&s[3])?,
                start_ns: s[4].as_u64()?,
                duration_ns: s[5].as_u64()?,
            })
        })
        .collect::<Option<Vec<Span>>>()?;
    Some(RankTrace { rank: value["rank"].as_u64()? as usize, stage: value["stage"].as_u64()? as usize, spans })
}
