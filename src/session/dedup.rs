//! POST de-duplication: the request ids of POSTs being forwarded right now ([`Forwarded`]),
//! and which retained stream of the session already carried one of a POST's ids
//! ([`carrier`]), so that a retransmission is answered from that stream and never forwarded.
//!
//! Pure bookkeeping under the session's lock: no locks, no waiting, nothing of HTTP or of how
//! a retransmission is answered (the session resumes the stream; the proxy responds).

use std::collections::BTreeMap;

use super::stream::Stream;

/// Request ids of POSTs forwarded and not yet settled (no stream opened for them, no answer
/// yet): a retransmission of one waits for it instead of being forwarded again.
#[derive(Debug, Default)]
pub(super) struct Forwarded {
    ids: Vec<String>,
}

impl Forwarded {
    /// Whether a POST carrying one of `ids` is in flight.
    pub fn any(&self, ids: &[String]) -> bool {
        ids.iter().any(|id| self.ids.contains(id))
    }

    /// Marks `ids` as forwarded; `false`, marking nothing, while one of them is in flight.
    pub fn begin(&mut self, ids: &[String]) -> bool {
        if self.any(ids) {
            return false;
        }
        self.ids.extend(ids.iter().cloned());
        true
    }

    /// The POST that carried `ids` settled: they are free again.
    pub fn settle(&mut self, ids: &[String]) {
        for id in ids {
            if let Some(i) = self.ids.iter().position(|f| f == id) {
                self.ids.swap_remove(i);
            }
        }
    }
}

/// A retained stream that was started by a POST carrying one of a retransmission's ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Carrier<'a> {
    pub stream: u32,
    /// The stream's opening position.
    pub first_seq: u64,
    /// The id it carried.
    pub id: &'a str,
}

/// The first retained stream (in stream order) that carried one of `ids`, with the first of
/// `ids` it carried; `None`: the POST is not a retransmission.
pub(super) fn carrier<'a>(
    streams: &BTreeMap<u32, Stream>,
    ids: &'a [String],
) -> Option<Carrier<'a>> {
    streams.iter().find_map(|(&stream, s)| {
        ids.iter().find(|id| s.carries(id)).map(|id| Carrier {
            stream,
            first_seq: s.first_seq,
            id,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::StreamKind;

    fn ids(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|&i| i.to_owned()).collect()
    }

    #[test]
    fn ids_in_flight_are_held_until_their_post_settles() {
        let mut f = Forwarded::default();
        assert!(f.begin(&ids(&["7", "8"])));
        assert!(f.any(&ids(&["1", "8"])));
        assert!(!f.begin(&ids(&["8", "9"])), "8 is in flight");
        assert!(!f.any(&ids(&["9"])), "a refused begin marks nothing");
        assert!(f.begin(&ids(&["9"])), "other ids are not held");
        f.settle(&ids(&["7", "8"]));
        assert!(!f.any(&ids(&["7", "8"])));
        assert!(f.any(&ids(&["9"])), "another POST's ids stay");
        assert!(f.begin(&ids(&["7", "8"])), "free again");
    }

    #[test]
    fn a_post_that_repeats_an_id_frees_it_entirely() {
        let mut f = Forwarded::default();
        assert!(f.begin(&ids(&["7", "7"])));
        f.settle(&ids(&["7", "7"]));
        assert!(!f.any(&ids(&["7"])));
        f.settle(&ids(&["7"])); // settling what is not held is harmless
        assert!(f.begin(&ids(&["7"])));
    }

    #[test]
    fn the_carrier_is_the_first_stream_that_carried_one_of_the_ids() {
        let post =
            |seq, requests: &[&str]| Stream::new(StreamKind::Post, seq, ids(requests), false, None);
        let streams = BTreeMap::from([
            (
                0,
                Stream::new(StreamKind::Standalone, 1, Vec::new(), false, None),
            ),
            (2, post(5, &["\"a\"", "3"])),
            (4, post(9, &["4", "5"])),
        ]);
        let dup = ids(&["5", "3"]);
        assert_eq!(
            carrier(&streams, &dup),
            Some(Carrier {
                stream: 2,
                first_seq: 5,
                id: "3"
            })
        );
        let dup = ids(&["1", "5", "4"]);
        assert_eq!(
            carrier(&streams, &dup).map(|c| (c.stream, c.id)),
            Some((4, "5"))
        );
        assert_eq!(
            carrier(&streams, &ids(&["a", "6"])),
            None,
            "ids are JSON text"
        );
        assert_eq!(carrier(&streams, &[]), None);
    }
}
