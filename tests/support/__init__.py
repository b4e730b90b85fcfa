"""What the tests share: factories for configs (`factories`), corpus builders (`corpus`,
`inputs`, `adversarial`, `tiny_run`), servers and processes they start (`moto`, `kube`,
`net`), the trainer's host-read counter (`host_sync`), the manifests' lint (`k8s_lint`),
an independent union-find (`union_find`, the clustering oracle) and small helpers
(`helpers`). Test modules import from here, never from each other."""
