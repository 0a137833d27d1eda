//! pprof's protobuf profile (`.pb.gz`), symbolized so that `go tool pprof`
//! needs no binary: the four heap sample types of Go's convention, values
//! already un-sampled. Messages per `profile.proto`, encoded with prost.
use std::{
    collections::HashMap,
    io::{self, Write},
};

use flate2::{Compression, write::GzEncoder};
use prost::Message;

use crate::{
    proc::parse_maps,
    profile::HeapProfile,
    symbolize::{Frame, Namer},
};

#[derive(Clone, PartialEq, Message)]
struct Profile {
    #[prost(message, repeated, tag = "1")]
    sample_type: Vec<ValueType>,
    #[prost(message, repeated, tag = "2")]
    sample: Vec<Sample>,
    #[prost(message, repeated, tag = "3")]
    mapping: Vec<Mapping>,
    #[prost(message, repeated, tag = "4")]
    location: Vec<Location>,
    #[prost(message, repeated, tag = "5")]
    function: Vec<Function>,
    #[prost(string, repeated, tag = "6")]
    string_table: Vec<String>,
    #[prost(message, optional, tag = "11")]
    period_type: Option<ValueType>,
    #[prost(int64, tag = "12")]
    period: i64,
    #[prost(int64, repeated, tag = "13")]
    comment: Vec<i64>,
}

#[derive(Clone, PartialEq, Message)]
struct ValueType {
    #[prost(int64, tag = "1")]
    r#type: i64,
    #[prost(int64, tag = "2")]
    unit: i64,
}

#[derive(Clone, PartialEq, Message)]
struct Sample {
    #[prost(uint64, repeated, tag = "1")]
    location_id: Vec<u64>,
    #[prost(int64, repeated, tag = "2")]
    value: Vec<i64>,
    #[prost(message, repeated, tag = "3")]
    label: Vec<Label>,
}

#[derive(Clone, PartialEq, Message)]
struct Label {
    #[prost(int64, tag = "1")]
    key: i64,
    #[prost(int64, tag = "2")]
    str: i64,
}

#[derive(Clone, PartialEq, Message)]
struct Mapping {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(uint64, tag = "2")]
    memory_start: u64,
    #[prost(uint64, tag = "3")]
    memory_limit: u64,
    #[prost(uint64, tag = "4")]
    file_offset: u64,
    #[prost(int64, tag = "5")]
    filename: i64,
    #[prost(bool, tag = "7")]
    has_functions: bool,
}

#[derive(Clone, PartialEq, Message)]
struct Location {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(uint64, tag = "2")]
    mapping_id: u64,
    #[prost(uint64, tag = "3")]
    address: u64,
    #[prost(message, repeated, tag = "4")]
    line: Vec<Line>,
}

#[derive(Clone, PartialEq, Message)]
struct Line {
    #[prost(uint64, tag = "1")]
    function_id: u64,
    #[prost(int64, tag = "2")]
    line: i64,
}

#[derive(Clone, PartialEq, Message)]
struct Function {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(int64, tag = "2")]
    name: i64,
    #[prost(int64, tag = "3")]
    system_name: i64,
    #[prost(int64, tag = "4")]
    filename: i64,
}

#[derive(Default)]
struct Strings {
    table: Vec<String>,
    index: HashMap<String, i64>,
}

impl Strings {
    fn new() -> Self {
        let mut strings = Self::default();
        strings.id(""); // string_table[0] must be "".
        strings
    }

    fn id(&mut self, s: &str) -> i64 {
        if let Some(&id) = self.index.get(s) {
            return id;
        }
        let id = self.table.len() as i64;
        self.table.push(s.to_owned());
        self.index.insert(s.to_owned(), id);
        id
    }
}

/// Writes `profile` as a gzipped pprof protobuf, naming frames with `namer`.
pub fn write<W: Write>(profile: &HeapProfile, namer: &mut Namer, out: W) -> io::Result<()> {
    let types = [
        ("alloc_objects", "count"),
        ("alloc_space", "bytes"),
        ("inuse_objects", "count"),
        ("inuse_space", "bytes"),
    ];
    let samples = profile.stacks.iter().map(|stack| {
        let values = [
            stack.alloc_objects,
            stack.alloc_bytes,
            stack.inuse_objects,
            stack.inuse_bytes,
        ];
        (
            stack.frames.as_slice(),
            values.map(|v| v.round() as i64).to_vec(),
            None,
        )
    });
    let contents = Contents {
        types: &types,
        period: profile.sample_interval as i64,
        comments: profile.notes.lines(),
    };
    encode(&contents, samples, &profile.mapped_libraries, namer, out)
}

/// What a pprof file holds besides its samples.
pub struct Contents<'a> {
    /// Each sample type and its unit.
    pub types: &'a [(&'a str, &'a str)],
    /// Bytes per sample (the profile's `period`, of type space).
    pub period: i64,
    /// `key: value` comments.
    pub comments: Vec<(String, String)>,
}

/// One sample: return addresses (innermost first), a value per sample
/// type, and an optional `(key, value)` label.
pub type LabeledSample<'a> = (&'a [u64], Vec<i64>, Option<(&'a str, &'a str)>);

/// Encodes `samples` as a gzipped pprof protobuf.
pub fn encode<'a, W: Write>(
    contents: &Contents<'_>,
    samples: impl Iterator<Item = LabeledSample<'a>>,
    maps: &str,
    namer: &mut Namer,
    out: W,
) -> io::Result<()> {
    let mut tables = Tables::default();
    let sample_type = contents
        .types
        .iter()
        .map(|(t, u)| ValueType {
            r#type: tables.strings.id(t),
            unit: tables.strings.id(u),
        })
        .collect();
    tables.add_mappings(maps);
    let mut sample = Vec::new();
    for (frames, value, label) in samples {
        let location_id = frames
            .iter()
            // The call instruction: return address - 1, leaf included.
            .map(|&frame| tables.location(frame.saturating_sub(1), namer))
            .collect();
        let label = label.map_or(Vec::new(), |(key, value)| {
            vec![Label {
                key: tables.strings.id(key),
                str: tables.strings.id(value),
            }]
        });
        sample.push(Sample {
            location_id,
            value,
            label,
        });
    }
    let mut strings = tables.strings;
    let comment = (contents.comments.iter())
        .map(|(k, v)| strings.id(&format!("{k}: {v}")))
        .collect();
    let period_type = Some(ValueType {
        r#type: strings.id("space"),
        unit: strings.id("bytes"),
    });
    let message = Profile {
        sample_type,
        sample,
        mapping: tables.mappings,
        location: tables.locations,
        function: tables.functions,
        string_table: strings.table,
        period_type,
        period: contents.period,
        comment,
    };
    let mut gz = GzEncoder::new(out, Compression::default());
    gz.write_all(&message.encode_to_vec())?;
    gz.finish()?;
    Ok(())
}

/// The profile's tables, each entry made once and referred to by id.
struct Tables {
    strings: Strings,
    mappings: Vec<Mapping>,
    locations: Vec<Location>,
    location_ids: HashMap<u64, u64>,
    functions: Vec<Function>,
    function_ids: HashMap<(String, Option<String>), u64>,
}

impl Default for Tables {
    fn default() -> Self {
        Self {
            strings: Strings::new(),
            mappings: Vec::new(),
            locations: Vec::new(),
            location_ids: HashMap::new(),
            functions: Vec::new(),
            function_ids: HashMap::new(),
        }
    }
}

impl Tables {
    /// The executable file mappings of the process.
    fn add_mappings(&mut self, maps: &str) {
        for m in parse_maps(maps)
            .into_iter()
            .filter(|m| m.is_executable() && m.is_file())
        {
            let filename = self.strings.id(m.path.as_deref().unwrap_or(""));
            self.mappings.push(Mapping {
                id: self.mappings.len() as u64 + 1,
                memory_start: m.start,
                memory_limit: m.end,
                file_offset: m.offset,
                filename,
                has_functions: true,
            });
        }
    }

    /// The location of a call instruction: one line per inlined function,
    /// innermost first, with its source line where debug info has one.
    fn location(&mut self, address: u64, namer: &mut Namer) -> u64 {
        if let Some(&id) = self.location_ids.get(&address) {
            return id;
        }
        let frames = namer.frames(address);
        let mapping = self
            .mappings
            .iter_mut()
            .find(|m| address >= m.memory_start && address < m.memory_limit);
        let mapping_id = mapping.as_ref().map_or(0, |m| m.id);
        // Code nothing could name stays a mapping and an address, which
        // `go tool pprof -symbolize` can name later from a debug file; its
        // mapping then no longer claims to have all its functions.
        let in_a_file = frames.iter().all(Frame::is_unknown) && mapping_id != 0;
        if in_a_file && let Some(mapping) = mapping {
            mapping.has_functions = false;
        }
        let line = if in_a_file {
            Vec::new()
        } else {
            frames
                .into_iter()
                .map(|frame| Line {
                    function_id: self.function(frame.function(), frame.file().map(str::to_owned)),
                    line: frame.line().map_or(0, i64::from),
                })
                .collect()
        };
        let id = self.locations.len() as u64 + 1;
        self.locations.push(Location {
            id,
            mapping_id,
            address,
            line,
        });
        self.location_ids.insert(address, id);
        id
    }

    fn function(&mut self, name: String, file: Option<String>) -> u64 {
        let key = (name, file);
        if let Some(&id) = self.function_ids.get(&key) {
            return id;
        }
        let id = self.functions.len() as u64 + 1;
        let name = self.strings.id(&key.0);
        let filename = self.strings.id(key.1.as_deref().unwrap_or(""));
        self.functions.push(Function {
            id,
            name,
            system_name: name,
            filename,
        });
        self.function_ids.insert(key, id);
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::ProfileNotes;
    use crate::profile::StackEstimate;

    #[test]
    fn decodes_back_with_four_sample_types_and_names() {
        let profile = HeapProfile {
            jit_symbols: Vec::new(),
            python_frames: Vec::new(),
            memory: None,
            account: None,
            pid: 1,
            sample_interval: 4096,
            stacks: vec![StackEstimate {
                frames: vec![0x1001, 0x2001],
                inuse_objects: 2.0,
                inuse_bytes: 8192.0,
                alloc_objects: 3.0,
                alloc_bytes: 12288.0,
                oldest_live_s: None,
            }],
            mapped_libraries: String::new(),
            notes: ProfileNotes {
                reason: Some("test".into()),
                ..ProfileNotes::default()
            },
        };
        let mut namer = Namer::new("", None);
        let mut gz = Vec::new();
        write(&profile, &mut namer, &mut gz).unwrap();
        let mut raw = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut raw).unwrap();
        let decoded = Profile::decode(&raw[..]).unwrap();
        assert_eq!(decoded.string_table[0], "");
        assert_eq!(decoded.sample_type.len(), 4);
        assert_eq!(decoded.sample[0].value, [3, 12288, 2, 8192]);
        assert_eq!(decoded.location[0].address, 0x1000);
        let name = decoded.function[0].name as usize;
        assert_eq!(decoded.string_table[name], "0x1000");
        assert_eq!(decoded.period, 4096);
    }
}
