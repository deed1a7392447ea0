//! A minimal tar (ustar) writer for adapter downloads: regular files only, in memory.

/// Appends one regular file to `archive`.
pub fn append(archive: &mut Vec<u8>, name: &str, data: &[u8]) -> Result<(), String> {
    if name.len() > 100 || name.is_empty() {
        return Err(format!("tar: name `{name}` must be 1 to 100 bytes"));
    }
    let mut header = [0u8; 512];
    header[..name.len()].copy_from_slice(name.as_bytes());
    let mut field = |at: usize, width: usize, value: u64| {
        let text = format!("{value:0w$o}\0", w = width - 1);
        header[at..at + width].copy_from_slice(text.as_bytes());
    };
    field(100, 8, 0o644); // mode
    field(108, 8, 0); // uid
    field(116, 8, 0); // gid
    field(124, 12, data.len() as u64); // size
    field(136, 12, 0); // mtime
    header[156] = b'0'; // regular file
    header[257..263].copy_from_slice(b"ustar\0");
    header[263..265].copy_from_slice(b"00");
    // The checksum is computed with its own field read as spaces.
    header[148..156].copy_from_slice(b"        ");
    let sum: u64 = header.iter().map(|&b| u64::from(b)).sum();
    let text = format!("{sum:06o}\0 ");
    header[148..156].copy_from_slice(text.as_bytes());
    archive.extend_from_slice(&header);
    archive.extend_from_slice(data);
    let pad = (512 - data.len() % 512) % 512;
    archive.extend(std::iter::repeat_n(0u8, pad));
    Ok(())
}

/// Ends the archive (two zero blocks).
pub fn finish(archive: &mut Vec<u8>) {
    archive.extend(std::iter::repeat_n(0u8, 1024));
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_system_tar_reads_what_is_written() {
        let mut archive = Vec::new();
        append(&mut archive, "a.json", b"{\"x\":1}").unwrap();
        append(&mut archive, "b.bin", &vec![7u8; 1000]).unwrap();
        finish(&mut archive);
        assert_eq!(archive.len() % 512, 0);
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
        assert_eq!(
            std::fs::read(dir.path().join("b.bin")).unwrap(),
            vec![7u8; 1000]
        );
        assert!(append(&mut Vec::new(), &"x".repeat(101), b"").is_err());
    }
}
