//! A minimal tar (ustar) writer for adapter downloads: regular files only. The headers
//! and padding are made here; the files' bytes stream from the store between them, so
//! an archive of any size is sent in the memory of one chunk ([`stream`]).

/// A tar block.
pub const BLOCK: usize = 512;

/// The header block of a regular file `name` of `size` bytes.
pub fn header(name: &str, size: u64) -> Result<[u8; BLOCK], String> {
    if name.len() > 100 || name.is_empty() {
        return Err(format!("tar: name `{name}` must be 1 to 100 bytes"));
    }
    let mut header = [0u8; BLOCK];
    header[..name.len()].copy_from_slice(name.as_bytes());
    let mut field = |at: usize, width: usize, value: u64| {
        let text = format!("{value:0w$o}\0", w = width - 1);
        header[at..at + width].copy_from_slice(text.as_bytes());
    };
    field(100, 8, 0o644); // mode
    field(108, 8, 0); // uid
    field(116, 8, 0); // gid
    field(124, 12, size); // size
    field(136, 12, 0); // mtime
    header[156] = b'0'; // regular file
    header[257..263].copy_from_slice(b"ustar\0");
    header[263..265].copy_from_slice(b"00");
    // The checksum is computed with its own field read as spaces.
    header[148..156].copy_from_slice(b"        ");
    let sum: u64 = header.iter().map(|&b| u64::from(b)).sum();
    let text = format!("{sum:06o}\0 ");
    header[148..156].copy_from_slice(text.as_bytes());
    Ok(header)
}

/// The zero bytes that follow a file of `size` bytes to the end of its last block.
pub fn padding(size: u64) -> usize {
    let rest = (size % BLOCK as u64) as usize;
    (BLOCK - rest) % BLOCK
}

/// The end of an archive: two zero blocks.
pub const TRAILER: usize = 2 * BLOCK;

/// The whole size of an archive of files of `sizes`.
pub fn archive_size(sizes: &[u64]) -> u64 {
    sizes
        .iter()
        .map(|&s| BLOCK as u64 + s + padding(s) as u64)
        .sum::<u64>()
        + TRAILER as u64
}

/// A file to archive: its name, its size, and its bytes as they stream in.
pub struct Entry<S> {
    /// Its name in the archive (1 to 100 bytes).
    pub name: String,
    /// Its size: exactly what `body` yields.
    pub size: u64,
    /// Its bytes.
    pub body: S,
}

/// The archive of `entries` as a stream, and its exact size: each file's bytes flow
/// from its own stream between its header and its padding, so the archive is never
/// held whole.
pub fn stream<S, E>(
    entries: Vec<Entry<S>>,
) -> Result<(u64, impl futures::Stream<Item = Result<bytes::Bytes, E>>), String>
where
    S: futures::Stream<Item = Result<bytes::Bytes, E>> + Unpin + 'static,
    E: 'static,
{
    use futures::StreamExt;
    let mut parts = Vec::new();
    let mut sizes = Vec::new();
    for entry in entries {
        let header = header(&entry.name, entry.size)?;
        let padding = bytes::Bytes::from(vec![0u8; padding(entry.size)]);
        sizes.push(entry.size);
        parts.push(
            futures::stream::once(async move { Ok(bytes::Bytes::copy_from_slice(&header)) })
                .chain(entry.body)
                .chain(futures::stream::once(async move { Ok(padding) }))
                .boxed_local(),
        );
    }
    parts.push(
        futures::stream::once(async { Ok(bytes::Bytes::from(vec![0u8; TRAILER])) }).boxed_local(),
    );
    Ok((archive_size(&sizes), futures::stream::iter(parts).flatten()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The archive [`stream`] makes of `files`, collected.
    fn archive(files: &[(&str, &[u8])]) -> (u64, Vec<u8>) {
        use futures::StreamExt;
        let entries = files
            .iter()
            .map(|(name, data)| Entry {
                name: name.to_string(),
                size: data.len() as u64,
                // Each file arrives in several chunks, as from a store.
                body: futures::stream::iter(
                    data.chunks(300)
                        .map(|c| Ok::<_, ()>(bytes::Bytes::copy_from_slice(c)))
                        .collect::<Vec<_>>(),
                ),
            })
            .collect();
        let (size, body) = stream(entries).unwrap();
        let chunks: Vec<Result<bytes::Bytes, ()>> =
            futures::executor::block_on(body.collect::<Vec<_>>());
        (size, chunks.into_iter().flat_map(|c| c.unwrap()).collect())
    }

    #[test]
    fn the_system_tar_reads_what_is_written() {
        let big = vec![7u8; 1000];
        let files: [(&str, &[u8]); 2] = [("a.json", b"{\"x\":1}"), ("b.bin", &big)];
        let (size, archive) = archive(&files);
        assert_eq!(archive.len() as u64, size);
        assert_eq!(size, archive_size(&[7, 1000]));
        assert_eq!(archive.len() % BLOCK, 0);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.tar");
        std::fs::write(&path, &archive).unwrap();
        let out = std::process::Command::new("tar")
            .arg("-xf")
            .arg(&path)
            .arg("-C")
            .arg(dir.path())
            .output()
            .expect("tar is part of every Debian system");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            std::fs::read(dir.path().join("a.json")).unwrap(),
            b"{\"x\":1}"
        );
        assert_eq!(std::fs::read(dir.path().join("b.bin")).unwrap(), big);
        assert!(header(&"x".repeat(101), 0).is_err());
        assert_eq!(padding(512), 0);
        assert_eq!(padding(513), 511);
    }
}
