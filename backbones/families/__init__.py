"""The families: one file each, ending with its ``FAMILY = Family(...)`` declaration.

``backbones._family.declared_families`` finds them; ``_``-files are helpers several families
share. A family that builds on another's helpers imports them from that family's file and
says so in its docstring (davit, gcvit and swinv2 on ``swin``; swinv2_cr on ``swinv2``;
efficientformer on ``metaformer``; gmlp and resmlp on ``mlp_mixer``; mobilenetv3 on
``efficientnet``; mobilenetv4 on ``mobilenetv3`` (and ghostnet on its head); beit, eva and vit_relpos on ``_prefix_vit``,
itself built on ``vit``; naflexvit on ``eva``, building its tokens as timm's ``NaFlexEmbeds``). torchvision's families are families like any other: tv_vit runs
``vit``'s attention; tv_swin takes ``swin``'s window shift and ``swinv2``'s cosine logits; tv_mobilenet builds on ``tv_efficientnet``; tv_convnext takes ``tv_resnet``'s head check and
tv_regnet its head; tv_maxvit shares ``maxxvit``'s partition labels and stem and runs its MBConvs by
``backbones._convnet``'s block events; the pooled CNNs (tv_resnet, tv_convnext, tv_efficientnet, tv_regnet, repvit,
starnet, convmixer, densenet, ghostnet, senet, vovnet) share ``backbones._convnet.AdaptedConvNet`` (densenet's, ghostnet's and
vovnet's concatenations are ``_convnet.Parallel`` branches); fastvit, repvit, repghost and byobnet fold their
re-parameterisable blocks' kernels with ``backbones._reparam``.
Round 3's later CNNs: res2net is ``resnet``'s adapter with Bottle2neck's block forward and paths (its split groups
``Parallel`` branches); resnest takes ``resnet``'s stem and head helpers; cspnet (DarkNet stages), vgg, hgnet,
mambaout and resnest build on ``AdaptedConvNet`` (cspnet and vgg read ``vovnet``'s ClassifierHead helpers; hgnet's HG
blocks and mambaout's gated blocks are ``Parallel`` concatenations); vit_hybrid runs ``resnet``'s or ``resnetv2``'s
CNN paths as its patch embedding, then ``vit``'s blocks. pit runs ``vit``'s blocks (``AdaptedViT``'s block walk,
``_vit_reference.reference_block``) with ``vit_hybrid``'s prefix-passing view; edgenext builds on ``AdaptedConvNet``
(its SDTA split chain as ``res2net``'s ``Parallel`` groups) with ``convnext``'s per-position head. vitamin is
``vit_hybrid``'s adapter over ViTamin's MbConv stages (its shared ``transformer_refusal``); inception_next takes
``mambaout``'s stage units, and fasternet ``inception_next``'s partial concatenation; xception_aligned reads
``resnetv2``'s ClassifierHead helpers; repghost is ``ghostnet``'s adapter and refusal loop (its fused kernel by
``repvit``'s and ``fastvit``'s helpers); tresnet reads ``vovnet``'s ClassifierHead helpers; selecsls builds on
``AdaptedConvNet`` alone. cspnet's cross stages and rexnet's partial shortcuts fork and join
the labels (``LabelTracker.fork``/``join``); vovnet, cspnet and rexnet share ``vovnet``'s ``HeadedConvNet``, and rexnet
takes ``cspnet``'s refusal frame and branch forward.
"""
